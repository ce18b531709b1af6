"""A worker's configuration: where it serves, how it registers, and its engine.

Built from the ``prefill``/``decode`` subcommands' flags by the CLI
(``pdserve.cli.configs.worker_config``); the engine's connector settings derive from
the same flags (the KV endpoint is advertised where the worker is).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from pdserve.core.grpc_options import DEFAULT_KEEPALIVE_S
from pdserve.core.grpc_tls import TlsFiles
from pdserve.membership import MembershipConfig
from pdserve.worker.engine import GPU_WEIGHT_TRANSFER_BACKENDS, EngineConfig, Role
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


def kv_events_name(worker_id: str) -> str:
    """The name of a worker's engine's KV event sockets (in its engine folder; where
    that is the operator's ``VLLM_RPC_BASE_PATH``, two workers of one id, from two
    ``pdserve up`` on a machine, must not share them: hence the pid)."""
    return f"{worker_id}-{os.getpid()}"


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


# Measured (bench/results/compare-prefill-admission*, chat mix, 2-core EPYC, one run per
# rate): one prompt at a time, shortest first, gave TTFT p50 0.378 s / p99 10.1 s at 1 req/s
# against 0.410 / 13.0 with no limit and 0.933 / 13.5 with one at a time in arrival order
# (a long prompt then holds up every short one behind it); at 2 req/s 1.98 / 17.9 against
# 2.78 / 23.5 and 2.28 / 20.4.
CPU_PREFILL_MAX_RUNNING = 1


def prefill_max_running_default(flag: int | None) -> int:
    """The flag's value; unset: one prompt at a time on CPU (one core computes one prompt
    fastest alone), no limit on a GPU (whose steps batch several prompts' chunks)."""
    if flag is not None:
        return flag
    import torch

    return 0 if torch.cuda.is_available() else CPU_PREFILL_MAX_RUNNING


def kv_push_default(flag: bool | None) -> bool:
    """Measured (``pdserve bench transfer-pd``, 2 CPU cores): push hides the transfer but its
    sender thread slows the prefill it overlaps, so it is on only with a GPU."""
    if flag is not None:
        return flag
    import torch

    return bool(torch.cuda.is_available())


def weight_transfer_backend(flag: str | None) -> str | None:
    """The flag's value, nccl and ipc refused without a GPU: they move a trainer's tensors
    GPU to GPU, and would fail only at the trainer's first ``init_weight_transfer_engine``
    (gloo moves them in host memory, ``gloo_transfer.py``)."""
    if flag is None:
        return None
    import torch

    if flag in GPU_WEIGHT_TRANSFER_BACKENDS and not torch.cuda.is_available():
        raise ValueError(f"--weight-transfer-backend {flag} needs a GPU; this machine has "
                         "none (gloo moves weights without one)")
    return flag
