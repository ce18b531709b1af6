"""Kept so old commands work: `pdserve bench transfer-pd` (pdserve/bench/tools/transfer_pd.py)."""

import sys

from pdserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "transfer-pd", *sys.argv[1:]]))
