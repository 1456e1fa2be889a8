#!/usr/bin/env python3
"""Build runtime engines from converted checkpoints (same as ``splitspec build``).

Example: ``python build/build_engine.py --checkpoints checkpoints/demo --out engines/demo --max-seq-len 2048``
"""

import sys

from splitspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["build", *sys.argv[1:]]))
