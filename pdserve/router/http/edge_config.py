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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_CONCURRENT = 256
DEFAULT_MAX_QUEUED = 1024
DEFAULT_MAX_QUEUE_WAIT_S = 30.0
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_DRAIN_TIMEOUT_S = 30.0
TENANT_ISOLATION = ("off", "key")


@dataclass(frozen=True)
class EdgeConfig:
    api_keys: tuple[str, ...] = ()  # empty: no client authentication
    admin_host: str = "127.0.0.1"
    admin_port: int = 0  # 0: no admin listener
    admin_keys: tuple[str, ...] = ()  # the admin actions' keys; empty: api_keys
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    max_queued: int = DEFAULT_MAX_QUEUED
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # ``key``: every request's cache salt is derived from its API key (``tenants.py``), so
    # clients of different keys share no cached KV; ``off``: only the requests' own salts.
    tenant_isolation: str = "off"

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

    def flags(self) -> list[str]:
        """The router flags that give this config back, but the keys: ``pdserve up``
        hands those to its router in the environment (``env()``), never on a command
        line that ``ps`` shows."""
        return ["--admin-host", self.admin_host, "--admin-port", str(self.admin_port),
                "--max-concurrent-requests", str(self.max_concurrent),
                "--max-queued-requests", str(self.max_queued),
                "--max-queue-wait-s", str(self.max_queue_wait_s),
                "--max-body-bytes", str(self.max_body_bytes),
                "--drain-timeout-s", str(self.drain_timeout_s),
                "--tenant-isolation", self.tenant_isolation]

    def env(self) -> dict[str, str]:
        env = {"PDSERVE_API_KEY": ",".join(self.api_keys)} if self.api_keys else {}
        if self.admin_keys:
            env["PDSERVE_ADMIN_KEY"] = ",".join(self.admin_keys)
        return env

    @property
    def admin_action_keys(self) -> tuple[str, ...]:
        """Who may call the admin actions (``router/admin.py``)."""
        return self.admin_keys or self.api_keys

    def probe_headers(self) -> dict[str, str]:
        """What a probe of the main port's admin views sends (``pdserve up``'s)."""
        return {"Authorization": f"Bearer {self.api_keys[0]}"} if self.api_keys else {}


def check_api_key(key: str) -> str:
    """A key must survive an HTTP header and a comma-separated environment variable."""
    if not key.isascii() or not key.isprintable() or " " in key or "," in key or len(key) < 8:
        raise ValueError("an API key is at least 8 printable ASCII characters, no spaces or "
                         "commas")
    return key


def read_api_key_file(path: Path) -> tuple[str, ...]:
    """One key per line; blank lines and ``#`` comments are skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read --api-key-file {path}: {exc.strerror}") from None
    keys = tuple(line.strip() for line in lines
                 if line.strip() and not line.strip().startswith("#"))
    for key in keys:
        try:
            check_api_key(key)
        except ValueError as exc:
            raise ValueError(f"--api-key-file {path}: {exc}") from None
    return keys
