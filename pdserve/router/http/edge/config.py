"""``EdgeConfig``: what the router's HTTP edge enforces before a request reaches the
dispatcher (client keys, admission, body size, drain), built once from the flags
(``pdserve.cli.configs.edge_config``).

Defaults, and why:

- 256 concurrent generation requests: vLLM's own default batch (``max_num_seqs``) per
  engine; the router holds one small coroutine and one gRPC stream per request, so this
  bounds the router's memory, not the workers' batching, which vLLM schedules itself.
- 1024 queued: a waiting request holds only its socket and a coroutine (its body is not
  read until it is admitted), so a queue of 4x the concurrency absorbs a burst cheaply.
- 30 s queue wait: long enough for a burst to pass, short enough that a client retrying
  elsewhere (after ``Retry-After``) beats waiting behind a saturated cluster.
- 4 MiB body: far above any prompt that fits ``max_model_len`` (a 128k-token prompt is
  about 0.5 MiB of text), small enough that the largest allowed body is cheap.
- 30 s drain: what Kubernetes gives a pod between SIGTERM and SIGKILL by default.

The keys and their tenants come from ``--api-key`` and ``--api-key-file`` entries, one
syntax for both (``tenants/table.py``); the admin plane's keys from ``--admin-key`` and
``--admin-key-file``, never a client key (a key that is both is refused). ``pdserve up``
hands them all to its router in the environment, never on a command line that ``ps``
shows.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.router.http.tenants.table import (
    KeyEntry,
    TenantSpec,
    check_api_key,
    parse_key_entry,
    render_key_table,
)

DEFAULT_MAX_CONCURRENT = 256
DEFAULT_MAX_QUEUED = 1024
DEFAULT_MAX_QUEUE_WAIT_S = 30.0
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_DRAIN_TIMEOUT_S = 30.0
TENANT_ISOLATION = ("off", "key")
NEEDS_SECRET = ("--tenant-isolation key needs --cluster-secret-file: the tenants' cache "
                "salts are keyed by the cluster secret")


@dataclass(frozen=True)
class EdgeConfig:
    # Keys never show in a repr (a logged config, a traceback's locals).
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: no client authentication
    admin_host: str = "127.0.0.1"
    admin_port: int = 0  # 0: no admin listener
    # The admin plane's keys (``--admin-key``, ``--admin-key-file``), never a client key;
    # empty: the admin listener binds loopback only, whatever admin_host says.
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    max_queued: int = DEFAULT_MAX_QUEUED
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # ``key``: every request's cache salt is derived from its API key (``tenants/salt.py``), so
    # clients of different keys share no cached KV; ``off``: only the requests' own salts.
    tenant_isolation: str = "off"
    # The named tenants (their keys are among api_keys); every other key is a tenant of
    # its own, key-<n>. ``tenant_limits_share``: the part of each tenant's limits this
    # router enforces (1/R in each of R replicas; the processes of one router share
    # their state instead, ``tenant_ledger``).
    tenants: tuple[TenantSpec, ...] = ()
    tenant_limits_share: float = 1.0
    # The weight-transfer routes that make workers connect somewhere: off unless a backend
    # is named; the addresses they may reach (CIDRs) are the operator's (``admin/transfer.py``).
    weight_transfer_backend: str | None = None
    weight_transfer_allow: tuple[str, ...] = ()
    # The file of the tenants' limit state that the processes of ``--processes N`` share
    # (``tenants/ledger.py``), set by their parent; None: this process's own memory.
    tenant_ledger: str | None = None

    def __post_init__(self) -> None:
        if self.max_concurrent < 1 or self.max_queued < 0 or self.max_body_bytes < 1:
            raise ValueError("need max_concurrent >= 1, max_queued >= 0, max_body_bytes >= 1")
        if self.max_queue_wait_s < 0 or self.drain_timeout_s < 0:
            raise ValueError("max_queue_wait_s and drain_timeout_s must be >= 0")
        for key in (*self.api_keys, *self.admin_keys):
            check_api_key(key)
        if self.tenant_isolation not in TENANT_ISOLATION:
            raise ValueError(f"tenant_isolation must be one of {', '.join(TENANT_ISOLATION)}")
        if self.tenant_isolation == "key" and not self.api_keys:
            raise ValueError("--tenant-isolation key needs API keys (--api-key, "
                             "--api-key-file): the tenants are the keys")
        if not 0 < self.tenant_limits_share <= 1:
            raise ValueError("tenant_limits_share must be in (0, 1]")
        members = [key for tenant in self.tenants for key in tenant.keys]
        if (len({t.name for t in self.tenants}) != len(self.tenants)
                or len(set(members)) != len(members) or not set(members) <= set(self.api_keys)
                or len(set(self.api_keys)) != len(self.api_keys)):
            raise ValueError("the API keys must be distinct, the tenants' names too, and each "
                             "tenant's keys distinct API keys of no other tenant")
        if set(self.admin_keys) & set(self.api_keys):
            raise ValueError("an admin key (--admin-key, --admin-key-file) must not also be a "
                             "client API key: a tenant would hold the admin plane")
        if not self.weight_transfer_backend and self.weight_transfer_allow:
            raise ValueError("--weight-transfer-allow needs --weight-transfer-backend")

    def env(self) -> dict[str, str]:
        """The keys and their tenants as ``--api-key`` entries (and no key file: they are
        all here, read once): ``pdserve up`` hands them to its router in its environment,
        never on a command line that ``ps`` shows."""
        env: dict[str, str] = {}
        if self.api_keys:
            env["PDSERVE_API_KEY"] = ",".join(render_key_table(self.api_keys, self.tenants))
            env["PDSERVE_API_KEY_FILE"] = ""
        if self.admin_keys:
            env["PDSERVE_ADMIN_KEY"] = ",".join(self.admin_keys)
            env["PDSERVE_ADMIN_KEY_FILE"] = ""
        return env

    def keys_summary(self) -> str:
        """For the start-up log line: how many keys and tenants, never which."""
        if not self.api_keys:
            return "no API keys"
        limited = sum(bool(t.limits) for t in self.tenants)
        return (f"{len(self.api_keys)} API key(s), {len(self.tenants)} named tenant(s) "
                f"({limited} with limits)")

    @property
    def admin_bind_host(self) -> str:
        """Where the admin listener binds: ``admin_host`` with an admin key, loopback
        without one (the admin plane is then open to the machine's own users only)."""
        if self.admin_keys or is_loopback(self.admin_host):
            return self.admin_host
        return "::1" if ":" in self.admin_host else "127.0.0.1"

    def admin_probe_headers(self) -> dict[str, str]:
        """What a probe of the admin listener's views sends (``pdserve up``'s)."""
        return {"Authorization": f"Bearer {self.admin_keys[0]}"} if self.admin_keys else {}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address) is this machine's own."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_admin_key_file(path: Path) -> tuple[str, ...]:
    """``--admin-key-file``: one key per line (blank lines and # comments skipped); a bad
    line raises ValueError naming its number, never its key."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read --admin-key-file {path}: {exc.strerror}") from None
    keys = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            check_api_key(text)
        except ValueError as exc:
            raise ValueError(f"--admin-key-file {path} line {number}: {exc}") from None
        keys.append(text)
    return tuple(keys)


def read_api_key_file(path: Path) -> Iterator[tuple[str, KeyEntry]]:
    """The file's key entries (``tenants/table.py``), each with where it is, for errors
    (``key_table``); a bad line raises ValueError naming its number, never its key."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read --api-key-file {path}: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        where = f"--api-key-file {path} line {number}"
        try:
            entry = parse_key_entry(line)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if entry is not None:
            yield where, entry
