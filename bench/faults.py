"""Kept so old commands work: `pdserve bench faults` (pdserve/bench/tools/faults.py)."""

import sys

from pdserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "faults", *sys.argv[1:]]))
