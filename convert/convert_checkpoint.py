#!/usr/bin/env python3
"""Convert a Hugging Face Kimi-K2 target and its EAGLE-3 drafter into rank-sharded checkpoints.

Same as ``splitspec convert``; kept here so the pipeline's stages stand where the design card puts them.
Example: ``python convert/convert_checkpoint.py --target models/demo/target --drafter models/demo/drafter --tp 8``
"""

import sys

from splitspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
