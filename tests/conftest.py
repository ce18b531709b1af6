"""Puts tests/ on sys.path so the shared helpers module (``pdserve_testing``) is
importable from test modules and from the processes they spawn."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
