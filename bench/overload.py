"""Kept so old commands work: `pdserve bench overload` (pdserve/bench/tools/overload.py)."""

import sys

from pdserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "overload", *sys.argv[1:]]))
