"""What a cluster operation raises when it is refused or fails: one ``ClusterError``
per kind of fault, each with a message, and an optional ``code`` (a stable name a client
can match, e.g. ``worker_not_found``) and ``param`` (the argument at fault).

The HTTP edge maps each kind to its status (``router/http/errors.py``): ``NotFound``
404, ``Invalid`` 400, ``Conflict`` 409 (the cluster's state refuses it now: another
update running, the last decode worker), ``Unavailable`` 503 (no worker could take it),
``Failed`` 500. The planner catches ``ClusterError`` and logs it.
"""

from __future__ import annotations


class ClusterError(Exception):
    """A cluster operation refused or failed."""

    def __init__(self, message: str, *, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class NotFound(ClusterError):
    """What it names is not in this router's view (a worker id)."""


class Invalid(ClusterError):
    """The caller's mistake: an argument no worker could take."""


class Conflict(ClusterError):
    """Refused by the cluster's state now; it may succeed later."""


class Unavailable(ClusterError):
    """No worker could take it (none there, or none answered)."""


class Failed(ClusterError):
    """It was tried and failed on the workers."""
