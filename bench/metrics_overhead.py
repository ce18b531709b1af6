"""Kept so old commands work: `pdserve bench metrics-overhead`."""

import sys

from pdserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "metrics-overhead", *sys.argv[1:]]))
