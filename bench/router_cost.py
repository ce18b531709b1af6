"""Kept so old commands work: `pdserve bench router-cost` (pdserve/bench/tools/router_cost.py)."""

import sys

from pdserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "router-cost", *sys.argv[1:]]))
