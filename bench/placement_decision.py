"""Kept so old commands work: `pdserve bench placement-decision`."""

import sys

from pdserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "placement-decision", *sys.argv[1:]]))
