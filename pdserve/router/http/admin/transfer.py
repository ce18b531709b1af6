"""Which weight-transfer calls may reach the workers: the routes that hand vLLM's
transfer engine a trainer's ``init_info`` / ``update_info`` make every worker connect
where those say (NCCL's ``master_address``: a TCP store whose peer the engine trusts).
So they are off unless the operator names the backend the workers run
(``--weight-transfer-backend``), and every host in a body must fall in a network the
operator allows (``--weight-transfer-allow CIDR``), checked before any worker is called.

A host field is any key (at any depth) named ``*address``, ``*addr``, ``*host``,
``*hostname``, ``*ip`` (or their plurals). An address literal is checked as it is; a
name is resolved and every address it has must be allowed, and the body goes on with
the name replaced by the first of them, so a later answer of the resolver (a rebinding
name) cannot send the workers elsewhere. A pickled payload (vLLM's
``ipc_handles_pickled``) is refused outright: unpickling a caller's bytes runs its code.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.http.errors import (
    InvalidRequestError,
    PermissionDeniedError,
    RouteNotFoundError,
)

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

HOST_FIELD = re.compile(r"(^|_)(address|addr|host|hostname|ip)(es|s)?$", re.IGNORECASE)
REFUSED_FIELDS = frozenset({"ipc_handles_pickled"})
# The fields vLLM 0.32's engines take, per (backend, body): anything else is refused, so
# a field a later engine adds (an ``init_method`` URL, an endpoint) cannot slip past the
# host check under a name it does not know (vllm/distributed/weight_transfer/). They are
# also all the workers' typed call can carry (``worker.proto``'s ``TransferInitInfo``,
# ``TransferUpdateInfo``). ipc's ``ipc_handles`` is not among them: JSON cannot hold a
# CUDA IPC handle's bytes, and vLLM's HTTP form of them is a pickle (refused below).
_TENSORS = frozenset({"names", "dtype_names", "shapes"})
_RENDEZVOUS = frozenset({"master_address", "master_port", "rank_offset", "world_size"})
KNOWN_FIELDS: dict[tuple[str, str], frozenset[str]] = {
    ("nccl", "init_info"): _RENDEZVOUS | {"nccl_unique_id_b64", "packed",
                                          "packed_buffer_size_bytes", "packed_num_buffers"},
    ("nccl", "update_info"): _TENSORS,
    # pdserve's own backend for CPUs (worker/vllm/gloo_transfer.py): nccl's unpacked protocol.
    ("gloo", "init_info"): _RENDEZVOUS,
    ("gloo", "update_info"): _TENSORS,
    ("ipc", "init_info"): frozenset({"packed"}),
    ("ipc", "update_info"): _TENSORS | {"tensor_sizes"},
}
BACKENDS = tuple(sorted({backend for backend, _ in KNOWN_FIELDS}))
RESOLVE_TIMEOUT_S = 5.0
REFUSED = "weight_transfer_address_refused"


@dataclass(frozen=True)
class WeightTransferPolicy:
    backend: str | None = None  # None: the transfer-engine routes answer 404
    allow: tuple[str, ...] = ()  # CIDRs; empty: every address refused
    _networks: tuple[IpNetwork, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"--weight-transfer-backend must be one of {', '.join(BACKENDS)}, "
                             f"not {self.backend!r}")
        try:
            nets = tuple(ipaddress.ip_network(c, strict=False) for c in self.allow)
        except ValueError as exc:
            raise ValueError(f"--weight-transfer-allow: {exc}") from None
        object.__setattr__(self, "_networks", nets)

    def require_enabled(self) -> None:
        """The 404 to answer while the routes are off."""
        if self.backend is None:
            raise RouteNotFoundError(
                "weight transfer is off on this router: start it with "
                "--weight-transfer-backend (and --weight-transfer-allow)",
                code="weight_transfer_disabled")

    async def checked(self, info: dict[str, Any], param: str) -> dict[str, Any]:
        """``info`` with every host checked (and names pinned to an address); raises the
        403 (400 for a host field that is not a string) before any worker is called."""
        self.require_enabled()
        known = KNOWN_FIELDS.get((str(self.backend), param), frozenset())
        unknown = sorted(str(key) for key in info if key not in known and
                         key not in REFUSED_FIELDS)
        if unknown:
            raise InvalidRequestError(
                f"{param}: {', '.join(unknown)} not among the {self.backend} engine's fields "
                f"({', '.join(sorted(known))})", param=param)
        return await self._walk(info, param)

    async def _walk(self, value: Any, where: str) -> Any:
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                path = f"{where}.{key}"
                if key in REFUSED_FIELDS:
                    raise PermissionDeniedError(
                        f"{path}: a pickled payload is never passed to workers",
                        code="pickle_refused")
                out[key] = (await self._hosts(item, path) if HOST_FIELD.search(str(key))
                            else await self._walk(item, path))
            return out
        if isinstance(value, list):
            return [await self._walk(item, f"{where}[{i}]") for i, item in enumerate(value)]
        return value

    async def _hosts(self, value: Any, where: str) -> Any:
        if value is None:
            return None
        if isinstance(value, list):
            return [await self._hosts(item, f"{where}[{i}]") for i, item in enumerate(value)]
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"{where} must be a host name or address", param=where)
        addresses = await _resolve(value, where)
        for address in addresses:
            if not any(address in net for net in self._networks):
                raise PermissionDeniedError(
                    f"{where} {value!r} ({address}) is outside the networks this router "
                    "lets workers reach (--weight-transfer-allow)", code=REFUSED)
        return value if _literal(value) is not None else str(addresses[0])


def _literal(host: str) -> IpAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


async def _resolve(host: str, where: str) -> Sequence[IpAddress]:
    literal = _literal(host)
    if literal is not None:
        return [literal]
    try:
        infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(
            host, None, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_S)
    except (OSError, TimeoutError):
        raise PermissionDeniedError(f"{where} {host!r} does not resolve", code=REFUSED
                                    ) from None
    addresses = list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0])
                                   for info in infos))
    if not addresses:
        raise PermissionDeniedError(f"{where} {host!r} does not resolve", code=REFUSED)
    return addresses
