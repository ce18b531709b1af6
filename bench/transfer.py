"""Kept so old commands work: `pdserve bench transfer` (pdserve/bench/tools/transfer.py)."""

import sys

from pdserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "transfer", *sys.argv[1:]]))
