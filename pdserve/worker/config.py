"""A worker's configuration: where it serves, how it registers, and its engine.

Built from the ``prefill``/``decode`` subcommands' flags by ``from_args``; the
engine's connector settings derive from the same flags (the KV endpoint is
advertised where the worker is).
"""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from dataclasses import dataclass

from pdserve.core.grpc_options import DEFAULT_KEEPALIVE_S
from pdserve.core.grpc_tls import TlsFiles
from pdserve.core.model import ResolvedModel
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.membership import MembershipConfig, check_name
from pdserve.worker.engine import EngineConfig, Role
from pdserve.worker.metrics import MetricsListener

_ANY_HOST = ("0.0.0.0", "::")


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    host: str  # gRPC bind address
    port: int
    advertise_host: str  # where the router and peers reach this worker
    membership: MembershipConfig
    engine: EngineConfig
    grpc_keepalive_s: float = DEFAULT_KEEPALIVE_S  # see pdserve.core.grpc_options
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may take
    tls: TlsFiles = TlsFiles()  # gRPC TLS (the cluster secret is the connector's)
    metrics: MetricsListener = MetricsListener("127.0.0.1", 0, "127.0.0.1")  # port 0: off

    @property
    def role(self) -> Role:
        return self.engine.role

    @classmethod
    def from_args(cls, args: argparse.Namespace, model: ResolvedModel) -> WorkerConfig:
        """From the ``prefill``/``decode`` subcommand's flags (``args.command`` is the role)."""
        role: Role = args.command
        worker_id = check_name("worker id", args.worker_id or f"{role}-{uuid.uuid4().hex[:8]}")
        advertise = args.advertise_host or default_advertise_host(args.host)
        connector = ConnectorConfig(
            engine_id=worker_id, transport=args.transport,
            kv_host=args.kv_host or advertise,
            kv_port=args.kv_port or args.port + 1000, kv_bind_host=args.host,
            lease_s=args.lease_s, kv_checksum=args.kv_checksum,
            kv_throttle_mib_s=args.kv_throttle_mib_s, push=kv_push_default(args.kv_push),
            cluster_secret_file=args.cluster_secret_file,
        )
        engine = EngineConfig(
            model_path=str(model.path), served_model_name=model.served_name, role=role,
            kv_events=_kv_event_endpoints(worker_id),
            connector=connector, dtype=args.dtype, max_model_len=args.max_model_len,
            kv_cache_gib=args.kv_cache_gib, cpu_threads_bind=args.cpu_cores,
            enforce_eager=not args.compile, num_kv_blocks=args.num_kv_blocks or None,
            shm_spin_s=args.shm_spin_s,
            prefill_chunk_tokens=prefill_chunk_default(args.prefill_chunk_tokens),
        )
        membership = MembershipConfig.from_flags(args.etcd, args.cluster, args.etcd_ttl_s)
        metrics = MetricsListener.from_flags(args.metrics_host, args.metrics_port, args.host,
                                             advertise)
        return cls(worker_id, args.host, args.port, advertise, membership, engine,
                   args.grpc_keepalive_s, args.drain_timeout_s, TlsFiles.from_args(args),
                   metrics)


def default_advertise_host(host: str) -> str:
    """Where peers reach a worker bound to ``host``: that address; bound to every
    interface, the address this machine's name resolves to (in a container or pod its
    own IP, so each replica of a scaled service advertises itself), or 127.0.0.1 when
    the name does not resolve."""
    if host not in _ANY_HOST:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _kv_event_endpoints(worker_id: str) -> tuple[str, str]:
    from pdserve.worker.vllm_kv_events import KvEventEndpoints

    # Socket files live in the shared temp dir: two workers of one id (two `pdserve up`
    # on a machine) must not share them.
    events = KvEventEndpoints.for_worker(f"{worker_id}-{os.getpid()}")
    return events.pub, events.replay


# A long local prefill beside decoding streams, on 2 CPU cores: ~1 ms per prompt token,
# so 256 tokens add ~0.25 s to a step instead of ~1.2 s for a 1,200-token prompt at once.
CPU_PREFILL_CHUNK_TOKENS = 256


def prefill_chunk_default(flag: int | None) -> int:
    """The flag's value; unset: ``CPU_PREFILL_CHUNK_TOKENS`` on CPU, no cap on a GPU
    (where a whole prompt's step is short)."""
    if flag is not None:
        return flag
    import torch

    return 0 if torch.cuda.is_available() else CPU_PREFILL_CHUNK_TOKENS


def kv_push_default(flag: bool | None) -> bool:
    """Measured (bench/transfer_pd.py, 2 CPU cores): push hides the transfer but its
    sender thread slows the prefill it overlaps, so it is on only with a GPU."""
    if flag is not None:
        return flag
    import torch

    return bool(torch.cuda.is_available())
