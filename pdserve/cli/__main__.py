"""``python -m pdserve.cli ...``: the same as the ``pdserve`` command (``python -m
pdserve.cli prefill`` is what ``python -m pdserve.roles.prefill`` was)."""

import sys

from pdserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
