"""Membership contracts: what a worker advertises, how the router learns the set.

Two sides meet here:

- a worker *registers* its ``WorkerInfo`` through a ``Registrar`` once its engine
  is ready, keeps it alive, and withdraws it on a clean shutdown;
- the router runs a ``Membership`` that reports the worker set to a
  ``MembershipSink`` (the router's worker pool): a full listing first, then
  changes.

etcd layout (docs/architecture.md, "Membership"): key
``/pdserve/<cluster>/workers/<role>/<worker_id>`` holds ``WorkerInfo.to_json()`` under a lease.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

ROLES = ("prefill", "decode")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


def check_name(what: str, value: str) -> str:
    """Cluster names and worker ids become etcd key segments: no ``/``, no spaces."""
    if not _NAME.match(value):
        raise ValueError(f"{what} {value!r} must be letters, digits, '_', '.', ':' or '-'")
    return value


def workers_prefix(cluster: str) -> str:
    return f"/pdserve/{check_name('cluster', cluster)}/workers/"


def worker_key(cluster: str, role: str, worker_id: str) -> str:
    return f"{workers_prefix(cluster)}{role}/{check_name('worker id', worker_id)}"


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker advertises. ``member_id`` (role/worker_id) names it in a view."""

    worker_id: str
    role: str
    grpc_endpoint: str  # host:port of the WorkerService
    # transport name -> host:port of the worker's KV endpoint for that transport
    kv_endpoints: Mapping[str, str] = field(default_factory=dict)
    model: str = ""
    dtype: str = ""
    block_size: int = 0
    compatibility_hash: str = ""
    max_model_len: int = 0
    # e.g. {"kv_cache_gib": 1, "num_kv_blocks": 120, "max_num_seqs": 64}
    capacity: Mapping[str, float] = field(default_factory=dict)
    # host:port of the worker's Prometheus /metrics listener; "" when off (and in
    # registrations written before it existed).
    metrics_endpoint: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {self.role!r}")
        check_name("worker id", self.worker_id)
        host, sep, port = self.grpc_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"grpc_endpoint must be host:port, not {self.grpc_endpoint!r}")

    @property
    def member_id(self) -> str:
        return f"{self.role}/{self.worker_id}"

    def to_json(self) -> bytes:
        data = asdict(self)
        data["kv_endpoints"] = dict(self.kv_endpoints)
        data["capacity"] = dict(self.capacity)
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> WorkerInfo:
        """Parse a registration; raises ``ValueError`` naming what is wrong."""
        try:
            data: Any = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"worker info is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("worker info must be a JSON object")
        known = set(cls.__dataclass_fields__)
        missing = {"worker_id", "role", "grpc_endpoint"} - data.keys()
        if missing:
            raise ValueError(f"worker info lacks {', '.join(sorted(missing))}")
        return cls(**{k: v for k, v in data.items() if k in known})


class MembershipSink(Protocol):
    """Receives the worker set (the router's worker pool implements it).

    Calls come from one asyncio task, in order. ``replace_all`` is a full listing:
    members absent from it are gone. ``put`` adds or updates one member (same
    ``member_id``: an update; a changed endpoint replaces the client). ``delete``
    removes one member; unknown ids are ignored.
    """

    async def replace_all(self, infos: Sequence[WorkerInfo]) -> None: ...

    async def put(self, info: WorkerInfo) -> None: ...

    async def delete(self, member_id: str) -> None: ...


class Membership(Protocol):
    """The router's source of workers.

    ``run(sink)`` reports a full listing, then every change, until cancelled; it
    never returns early and never raises for a store outage: while the store is
    unreachable the sink keeps the last-known set (the pool's own health checks
    still drop dead workers), and on reconnect ``run`` lists again. Every call to
    the store has a deadline. ``describe()`` is a JSON-able status for ``/workers``.
    """

    name: str

    async def run(self, sink: MembershipSink) -> None: ...

    def describe(self) -> dict[str, object]: ...


class Registrar(Protocol):
    """A worker's registration.

    ``start(info)`` publishes ``info`` (once the engine is ready) and keeps it
    alive in the background until ``close()``; if the registration is lost (a
    lease expired while the process was paused, the store restarted empty) it is
    published again. ``start`` returns once a first attempt ended (published, or
    failed and left to retry); it never raises for a store outage. ``close()``
    withdraws the registration (best effort, bounded) and stops the background
    work.
    """

    async def start(self, info: WorkerInfo) -> None: ...

    async def update(self, info: WorkerInfo) -> None:
        """Replace the published info (a role switch: the key moves to the new role's
        prefix). Like ``start``, never raises for a store outage: the background work
        publishes it once the store answers."""
        ...

    async def close(self) -> None: ...
