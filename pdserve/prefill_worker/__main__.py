"""``python -m pdserve.prefill_worker``: the same as ``pdserve prefill``."""

import sys

from pdserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["prefill", *sys.argv[1:]]))
