"""The connector's settings, carried in vLLM's ``kv_connector_extra_config``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pdserve.core.cluster_secret import ClusterSecret, optional_secret
from pdserve.core.grpc_tls import TlsFiles
from pdserve.kv_transfer.base import TransportOptions, transport_names
from pdserve.kv_transfer.control.tls import KvTls, load_kv_tls
from pdserve.kv_transfer.remote.base import (
    TLS_SCHEMES,
    StoreOptions,
    check_store_tls,
    check_store_url,
)
from pdserve.kv_transfer.remote.local_redis import read_password
from pdserve.kv_transfer.tiers.policies.registry import check_admission, check_policy

KV_COMPRESSIONS = ("none", "lossless", "int8", "fp8")


@dataclass(frozen=True)
class ConnectorConfig:
    engine_id: str
    transport: str = "tcp"
    # Address decode workers use to reach this worker's KV endpoint, and the
    # base port (tensor-parallel rank r listens on kv_port + r).
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_bind_host: str = "0.0.0.0"
    lease_s: float = 30.0
    transfer_timeout_s: float = 30.0
    # A pull whose peer sends no byte (or answers no connect) for this long fails: the
    # decode recomputes (a cut link or a frozen prefill costs this, not the deadline).
    kv_stall_s: float = 10.0
    # How long the rate measured to a peer is believed without a new pull from it.
    kv_link_max_age_s: float = 60.0
    kv_handoff_lossy: bool = False  # a lossy --kv-compression encodes handoffs too
    pull_threads: int = 4
    # Layer-wise push: a prefill sends each layer's blocks to the decode the router
    # named while its forward pass runs; decodes keep pushed KV in a bounded inbox.
    push: bool = True
    push_inbox_mib: int = 1024
    # How long a decode waits for pushed KV to be complete before pulling instead.
    push_wait_s: float = 5.0
    # Checksum every transfer (a mismatch fails the load; vLLM recomputes).
    kv_checksum: bool = False
    # Pace the sending side to this many MiB/s (0: off); emulates a slow link.
    kv_throttle_mib_s: float = 0.0
    # The host tier under the engine's KV cache (GiB; 0: off): finished requests' blocks
    # are saved there, and a prompt whose prefix the engine evicted loads it back.
    kv_offload_gib: float = 0.0
    # The disk tier below it (a folder, and its size in GiB; both or neither): blocks
    # are written through to slot files there and survive a restart of the worker.
    kv_disk_dir: str | None = None
    kv_disk_gib: float = 0.0
    # Which block both tiers evict and admit (``tiers.policies.registry``).
    kv_tier_policy: str = "default"
    # The cluster KV store (``remote/``): its URL (None: off), each block's lifetime in
    # it, each call's deadline, the password's file (never the password: this config
    # lands in vLLM's, which vLLM logs) and how its blocks are encoded.
    kv_store: str | None = None
    kv_store_ttl_s: float = 3600.0
    kv_store_timeout_s: float = 0.5
    kv_store_password_file: str | None = None
    # A rediss:// store's TLS files where they are not the cluster's (tls_* below): the CA
    # that signed the store's certificate, the client certificate and its key (paths).
    kv_store_tls_ca: str | None = None
    kv_store_tls_cert: str | None = None
    kv_store_tls_key: str | None = None
    kv_compression: str = "none"
    # Which new blocks are worth writing to the store (``remote/admission.py``; the
    # tiers' policy names, or ``all``).
    kv_store_admission: str = "all"
    # The cluster secret's file (never the secret: this config lands in vLLM's, which
    # vLLM logs); None: KV connections are not authenticated.
    cluster_secret_file: str | None = None
    # Mutual TLS on every KV control connection (and so on the tcp transport's bytes):
    # the PEM files' paths, never their content; ``require_tls``: refuse to start
    # without it, or on a transport whose KV bytes bypass it.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    require_tls: bool = False

    def __post_init__(self) -> None:
        if min(self.lease_s, self.transfer_timeout_s, self.push_wait_s, self.kv_stall_s) <= 0:
            raise ValueError("lease_s, transfer_timeout_s, push_wait_s and kv_stall_s must be "
                             "> 0")
        if self.push_inbox_mib < 0:
            raise ValueError("push_inbox_mib must be >= 0")
        if not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_port {self.kv_port} out of range")
        if self.kv_offload_gib < 0 or self.kv_disk_gib < 0:
            raise ValueError("kv_offload_gib and kv_disk_gib must be >= 0")
        if bool(self.kv_disk_dir) != (self.kv_disk_gib > 0):
            raise ValueError("the disk tier needs both kv_disk_dir and kv_disk_gib > 0")
        check_policy(self.kv_tier_policy)
        self._check_store()
        if self.kv_throttle_mib_s < 0:
            raise ValueError(f"kv_throttle_mib_s must be >= 0, got {self.kv_throttle_mib_s}")
        names = transport_names()
        if self.transport not in names:
            raise ValueError(
                f"unknown KV transport {self.transport!r}; valid transports: {', '.join(names)}")
        self.cluster_secret()  # a bad secret file fails here, in the worker, not in vLLM
        if self.require_tls and self.transport != "tcp":
            raise ValueError(f"--require-tls: the {self.transport} transport moves KV bytes "
                             "outside the TLS control channel, unencrypted; use --transport tcp")
        self.kv_tls()  # and so do bad TLS files

    def _check_store(self) -> None:
        if self.kv_store_ttl_s <= 0 or self.kv_store_timeout_s <= 0:
            raise ValueError("kv_store_ttl_s and kv_store_timeout_s must be > 0")
        if self.kv_compression not in KV_COMPRESSIONS:
            raise ValueError(f"unknown KV compression {self.kv_compression!r}; valid: "
                             f"{', '.join(KV_COMPRESSIONS)}")
        check_admission(self.kv_store_admission)
        if self.kv_store is None:
            return
        check_store_url(self.kv_store)
        parts = urlsplit(self.kv_store)
        check_store_tls(self.kv_store, self.require_tls)
        if bool(self.kv_store_tls_cert) != bool(self.kv_store_tls_key):
            raise ValueError("--kv-store-tls-cert and --kv-store-tls-key go together")
        if parts.scheme in TLS_SCHEMES:
            self.store_tls().load()  # an unreadable file fails in the worker, not in vLLM

    def store_tls(self) -> TlsFiles:
        """A rediss:// store's files: --kv-store-tls-*, else the cluster's --tls-*."""
        cert, key = ((self.kv_store_tls_cert, self.kv_store_tls_key) if self.kv_store_tls_cert
                     else (self.tls_cert, self.tls_key))
        return TlsFiles(cert, key, self.kv_store_tls_ca or self.tls_ca)

    def store_options(self) -> StoreOptions:
        """The KV store client's deadline, password (read from its file now) and TLS
        files."""
        password = None
        if self.kv_store_password_file:  # its first line, as redis-server's requirepass
            password = read_password(Path(self.kv_store_password_file))
        return StoreOptions(timeout_s=self.kv_store_timeout_s, password=password,
                            tls=self.store_tls())

    def tls_files(self) -> TlsFiles:
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca, required=self.require_tls)

    def kv_tls(self) -> KvTls | None:
        """The TLS contexts (loaded once per process), or None for plaintext KV."""
        return load_kv_tls(self.tls_files())

    def cluster_secret(self) -> ClusterSecret | None:
        """The secret (read once per process), or None for an unauthenticated cluster."""
        return optional_secret(self.cluster_secret_file)

    def transport_options(self) -> TransportOptions:
        return TransportOptions(checksum=self.kv_checksum,
                                throttle_bytes_per_s=self.kv_throttle_mib_s * (1 << 20),
                                secret=self.cluster_secret(), tls=self.kv_tls(),
                                stall_s=self.kv_stall_s,
                                link_max_age_s=self.kv_link_max_age_s,
                                handoff_lossy=self.kv_handoff_lossy)

    def to_extra_config(self) -> dict[str, Any]:
        return {"pdserve": asdict(self)}

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorConfig:
        if "pdserve" not in extra:
            raise ValueError("kv_connector_extra_config has no 'pdserve' section")
        return cls(**extra["pdserve"])
