"""``python -m pdserve.decode_worker``: the same as ``pdserve decode``."""

import sys

from pdserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["decode", *sys.argv[1:]]))
