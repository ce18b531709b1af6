"""Kept so old commands work: `pdserve bench ttft` (pdserve/bench/tools/ttft.py)."""

import sys

from pdserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "ttft", *sys.argv[1:]]))
