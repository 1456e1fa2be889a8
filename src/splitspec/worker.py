"""Entry point of a target worker rank: ``python -m splitspec.worker --engine DIR --rank R --world N --store-port P``."""

import argparse
from pathlib import Path

from splitspec.engine import worker_loop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engine", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    worker_loop(Path(a.engine), a.rank, a.world, a.store_port, a.device)


if __name__ == "__main__":
    main()
