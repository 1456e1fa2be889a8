"""Entry point of a target worker rank:
``python -m splitspec.engine.worker --engines DIR --rank R --world N --store-port P [--device cuda:R] [--draft-tp 1,N]``.

The leader's :class:`splitspec.settings.ServeConfig` switches arrive as options (``--no-compile``,
``--no-cuda-graphs``, ``--collective-timeout-s``); a worker reads no ``SPLITSPEC_*`` variable."""

import signal

# Ctrl-C in a terminal reaches every process of the group: rank 0 handles it and stops this rank (shutdown plan,
# or a kill if it is stuck in a collective). Ignored before the imports below, which take seconds (torch): a
# Ctrl-C during them would otherwise end this rank with a KeyboardInterrupt traceback.
signal.signal(signal.SIGINT, signal.SIG_IGN)

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from splitspec.engine.group import worker_loop  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engines", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--draft-tp", default="1", help="comma list: the drafter placements loaded (1 and/or N)")
    p.add_argument("--kv-tokens", type=int, default=0, help="KV token budget (0: the engine's default)")
    p.add_argument("--no-compile", action="store_true", help="do not torch.compile the target's layers")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run steady cycles eagerly, without CUDA graphs")
    p.add_argument("--collective-timeout-s", type=int, default=300, help="how long a collective may wait, seconds")
    a = p.parse_args()
    try:
        worker_loop(Path(a.engines), a.rank, a.world, a.store_port, a.device, tuple(int(x) for x in a.draft_tp.split(",")),
                    a.kv_tokens or None, compile=not a.no_compile, cuda_graphs=not a.no_cuda_graphs,
                    collective_timeout_s=a.collective_timeout_s)
    except RuntimeError as e:
        if "Connection closed by peer" not in str(e):
            raise
        # rank 0 went away without a shutdown plan (killed): its own failure is what gets reported
        sys.exit(f"splitspec worker rank {a.rank}: rank 0 closed the group's connection; exiting")


if __name__ == "__main__":
    main()
