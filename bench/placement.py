"""Kept so old commands work: `pdserve bench placement` (pdserve/bench/tools/placement.py)."""

import sys

from pdserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "placement", *sys.argv[1:]]))
