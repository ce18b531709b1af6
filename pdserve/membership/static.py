"""Static membership: the workers named by flags or a JSON file, for one machine
with no etcd. Workers register nowhere (``NullRegistrar``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

from pdserve.membership.base import ROLES, MembershipSink, WorkerInfo


def static_infos(prefill: Sequence[str], decode: Sequence[str]) -> list[WorkerInfo]:
    """Members for endpoints given on the command line. Their ids are the endpoints
    until a health check tells the router the worker's own id."""
    return [WorkerInfo(worker_id=endpoint, role=role, grpc_endpoint=endpoint)
            for role, endpoints in (("prefill", prefill), ("decode", decode))
            for endpoint in endpoints]


def load_workers_file(path: str | Path) -> tuple[list[str], list[str]]:
    """``{"prefill": ["host:port", ...], "decode": [...]}`` -> (prefill, decode)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read workers file {path}: {exc}") from None
    if not isinstance(data, dict) or set(data) - set(ROLES):
        raise ValueError(f"workers file {path} must be an object with keys {', '.join(ROLES)}")
    lists = [data.get(role, []) for role in ROLES]
    if not all(isinstance(v, list) and all(isinstance(e, str) for e in v) for v in lists):
        raise ValueError(f"workers file {path}: each role maps to a list of 'host:port'")
    return lists[0], lists[1]


class StaticMembership:
    name = "static"

    def __init__(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        self._infos = static_infos(prefill, decode)

    async def run(self, sink: MembershipSink) -> None:
        await sink.replace_all(self._infos)
        await asyncio.Event().wait()  # nothing ever changes; runs until cancelled

    def describe(self) -> dict[str, object]:
        return {"kind": self.name, "num_members": len(self._infos)}


class NullRegistrar:
    """Registration for static membership: the router is told by flags."""

    async def start(self, info: WorkerInfo) -> None:
        return None

    async def update(self, info: WorkerInfo) -> None:
        """The routers learn a switched role from the worker's Health."""
        return None

    async def close(self) -> None:
        return None
