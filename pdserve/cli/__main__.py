"""``python -m pdserve.cli ...``: the same as the ``pdserve`` command (``python -m
pdserve.cli prefill`` is what ``python -m pdserve.prefill_worker`` was)."""

import sys

from pdserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
