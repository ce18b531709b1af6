"""pdserve's version, looked up in one place."""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version


@cache
def version() -> str:
    """The installed distribution's version; ``"unknown"`` in a source tree that was
    never installed."""
    try:
        return _dist_version("pdserve")
    except PackageNotFoundError:
        return "unknown"
