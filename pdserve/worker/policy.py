"""The per-role half of a worker: ``RolePolicy``. ``EngineHost`` is the same for
both roles; each role folder supplies a policy (``roles/prefill/policy.py``,
``roles/decode/policy.py``) instead of phase branches in the host."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from pdserve.core.handle import KVHandle
from pdserve.core.types import PhaseRequest, Role
from pdserve.worker.engine import EngineParams


class AdmissionAborted(Exception):
    """Raised by ``RolePolicy.admitted`` to a request aborted while it waited for its
    turn: it never entered the engine, and ends as an aborted request does."""


class _AtOnce(AbstractAsyncContextManager[float]):
    async def __aexit__(self, *exc: object) -> None:
        return None

    async def __aenter__(self) -> float:
        return 0.0


_AT_ONCE = _AtOnce()


class RolePolicy(Protocol):
    """What one role decides about a request on the shared ``EngineHost``.

    The host owns the engine, the in-flight set and the output stream; the policy
    owns what differs by role: the engine parameters of a request (its
    ``kv_transfer_params``), when it enters the engine (prefill: its admission), what a
    finished request leaves behind (prefill: a KV handle under a lease, held until
    released or expired) and how an abort frees it. Every method runs on the worker's
    event loop. A role that holds nothing past a request (decode) subclasses this and
    inherits the defaults below; ``role`` and ``engine_params`` every role decides.
    """

    @property
    def role(self) -> Role: ...

    def engine_params(self, request: PhaseRequest) -> EngineParams:
        """The engine's ``max_tokens`` and ``kv_transfer_params`` for ``request``."""
        ...

    def admitted(self, request: PhaseRequest) -> AbstractAsyncContextManager[float]:
        """Held while ``request`` is in the engine: it waits here for its turn (prefill:
        ``roles/prefill/admission.py``); yields the seconds it waited, or raises
        ``AdmissionAborted`` when ``abort_waiting`` ended the wait. By default every
        request enters at once."""
        return _AT_ONCE

    @property
    def num_waiting(self) -> int:
        """Requests waiting for their turn in ``admitted``."""
        return 0

    def abort_waiting(self, request_id: str) -> bool:
        """End ``request_id``'s wait in ``admitted`` (it raises ``AdmissionAborted``);
        False when it is not waiting."""
        return False

    def on_finished(self, request: PhaseRequest,
                    kv_transfer_params: dict[str, Any] | None) -> KVHandle | None:
        """``request``'s last output came with these params from the connector;
        returns the KV handle to hand back (recording its lease), if any."""
        return None

    async def release(self, request_id: str) -> bool:
        """The router aborted ``request_id``: free what this role holds for it
        (may block on the network, off the loop); True if it held anything."""
        return False

    async def release_all(self) -> int:
        """A role switch's drain ran out: free everything this role still holds (off
        the loop where it blocks); how many requests held anything."""
        return 0

    def prune(self, now_ns: int) -> None:
        """Forget what expired by ``now_ns`` (unix ns); called on every GetLoad."""
        return None
