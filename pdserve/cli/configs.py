"""Every component's frozen config, built from the parsed command line in one place.

Each flag also reads its ``PDSERVE_<FLAG>`` environment variable (``flags.py``), so
the parsed ``argparse.Namespace`` is the whole of what the user asked for; one small
builder per config turns it into that component's frozen config, and no component
below the CLI ever sees argparse. Configs whose modules are slow to import (the
router's web stack, ``up``'s supervisor, the worker's engine) are imported by their
builder, so one subcommand does not load every other one's dependencies.
"""

from __future__ import annotations

import argparse
import dataclasses
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.cli.flags import FLAGS
from pdserve.cli.parser import DISAGG, EDGE, ENGINE, OPENAI, TRANSPORT
from pdserve.core.grpc_tls import TlsFiles
from pdserve.core.lora import LoraConfig
from pdserve.core.model import ResolvedModel
from pdserve.membership import EtcdAuth, MembershipConfig
from pdserve.router.dispatch.policies.disagg import DisaggConfig
from pdserve.router.dispatch.policies.planner import PlannerConfig
from pdserve.router.dispatch.policies.slo import SloConfig
from pdserve.router.http.edge.config import (
    EdgeConfig,
    read_admin_key_file,
    read_api_key_file,
)
from pdserve.router.http.tenants.table import key_table, parse_key_entry

if TYPE_CHECKING:
    from pdserve.kv_transfer.config import ConnectorConfig
    from pdserve.launch.up import UpConfig
    from pdserve.launch.up_store import KvStoreUp
    from pdserve.router.http.openai.tool_calls import ToolConfig
    from pdserve.router.server import RouterConfig
    from pdserve.worker.config import WorkerConfig
    from pdserve.worker.engine import EngineConfig, Role
    from pdserve.worker.metrics import MetricsListener
    from pdserve.worker.sim.engine import SimConfig


# ---- shared by several subcommands ----------------------------------------------------

def tls_files(args: argparse.Namespace) -> TlsFiles:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca`` (router, workers, ``up``)."""
    return TlsFiles(args.tls_cert, args.tls_key, args.tls_ca,
                    required=bool(getattr(args, "require_tls", False)))


def worker_membership(args: argparse.Namespace) -> MembershipConfig:
    """A worker's registration (vLLM or simulated): etcd with ``--etcd`` (TLS for an
    https:// URL, with the ``--tls-*`` files), else static. Its entry is signed with the
    cluster secret (``--cluster-secret-file``), if any."""
    return MembershipConfig.from_flags(args.etcd, args.cluster, args.etcd_ttl_s,
                                       tls=tls_files(args), auth=etcd_auth(args),
                                       secret_file=args.cluster_secret_file)


def etcd_auth(args: argparse.Namespace) -> EtcdAuth:
    """``--etcd-user``, ``--etcd-password-file`` (router, workers, ``up``)."""
    return EtcdAuth(args.etcd_user or "", args.etcd_password_file or "")


def metrics_listener(args: argparse.Namespace, advertise_host: str) -> MetricsListener:
    """A worker's ``/metrics`` listener (``--metrics-host``, ``--metrics-port``)."""
    from pdserve.worker.metrics import MetricsListener

    return MetricsListener.from_flags(args.metrics_host, args.metrics_port, args.host,
                                      advertise_host)


# ---- the router's parts (``router``, and ``up`` hands them to its router) --------------

def disagg_config(args: argparse.Namespace) -> DisaggConfig:
    """From the ``--disagg`` / ``--local-*`` / ``--slo-*`` flags."""
    return DisaggConfig(mode=args.disagg, local_prefill_max_tokens=args.local_prefill_max_tokens,
                        local_prefill_max_queued_tokens=args.local_prefill_max_queued_tokens,
                        local_decode_max_running=args.local_decode_max_running,
                        slo=SloConfig(args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3),
                        link_aware=args.link_aware)


def planner_config(args: argparse.Namespace) -> PlannerConfig:
    """From the ``--planner*`` flags."""
    return PlannerConfig(mode=args.planner, interval_s=args.planner_interval_s,
                         window_s=args.planner_window_s, hold_s=args.planner_hold_s,
                         cooldown_s=args.planner_cooldown_s,
                         demand_scale=args.planner_demand_scale)


def tool_config(args: argparse.Namespace) -> ToolConfig:
    """From ``--tool-call-parser`` and ``--enable-auto-tool-choice``."""
    from pdserve.router.http.openai.tool_calls import ToolConfig

    return ToolConfig(parser=args.tool_call_parser or None,
                      enable_auto=bool(args.enable_auto_tool_choice))


def handed_on(args: argparse.Namespace, names: Sequence[str]) -> tuple[str, ...]:
    """The flags ``names`` as parsed, for a child process to parse again (each flag's
    own ``Flag.argv``): ``up`` hands its router and its workers their flags this way."""
    return tuple(word for name in names
                 for word in FLAGS[name].argv(getattr(args, FLAGS[name].dest)))


def edge_config(args: argparse.Namespace) -> EdgeConfig:
    """From the edge flags (keys and tenants, admin listener, admission, body size,
    drain, weight-transfer routes); reads ``--api-key-file`` and ``--admin-key-file``."""
    entries = [(f"--api-key entry {number}", entry)
               for number, text in enumerate(args.api_key or (), 1)
               if (entry := parse_key_entry(text)) is not None]
    if args.api_key_file:
        entries += read_api_key_file(Path(args.api_key_file))
    keys, tenants = key_table(entries)
    admin_keys = tuple(args.admin_key or ())
    if args.admin_key_file:
        admin_keys += read_admin_key_file(Path(args.admin_key_file))
    return EdgeConfig(api_keys=keys, tenants=tenants, admin_host=args.admin_host,
                      admin_port=args.admin_port,
                      admin_keys=tuple(dict.fromkeys(admin_keys)),
                      weight_transfer_backend=args.weight_transfer_backend,
                      weight_transfer_allow=tuple(dict.fromkeys(
                          args.weight_transfer_allow or ())),
                      max_concurrent=args.max_concurrent_requests,
                      max_queued=args.max_queued_requests,
                      max_queue_wait_s=args.max_queue_wait_s,
                      max_body_bytes=args.max_body_bytes, drain_timeout_s=args.drain_timeout_s,
                      tenant_isolation=args.tenant_isolation,
                      tenant_limits_share=args.tenant_limits_share)


def router_config(args: argparse.Namespace, model: ResolvedModel) -> RouterConfig:
    """From the ``router`` subcommand's flags."""
    from pdserve.router.dispatch.migration import MigrationConfig
    from pdserve.router.server import RouterConfig

    prefill, decode = _endpoints(args.prefill), _endpoints(args.decode)
    return RouterConfig(
        model_path=str(model.path),
        served_model_name=args.served_model_name or model.served_name,
        prefill=prefill, decode=decode, host=args.host, port=args.port,
        max_model_len=args.max_model_len, placement=args.placement,
        kv_pool=args.kv_pool == "on", decode_cache=args.decode_cache == "on",
        disagg=disagg_config(args),
        log_timeline=args.log_timeline, metrics=not args.disable_metrics,
        request_timeout_s=args.request_timeout_s,
        grpc_keepalive_s=args.grpc_keepalive_s,
        migration=MigrationConfig(max_migrations=args.max_migrations),
        edge=dataclasses.replace(edge_config(args), tenant_ledger=args.tenant_ledger),
        membership=MembershipConfig.from_flags(
            args.etcd, args.cluster, args.etcd_ttl_s, prefill, decode, args.workers_file,
            tls_files(args), etcd_auth(args), args.cluster_secret_file),
        cluster_secret_file=args.cluster_secret_file, tls=tls_files(args),
        planner=planner_config(args), tools=tool_config(args), reuse_port=args.reuse_port,
        weight_board=args.weight_board,
    )


def _endpoints(value: str) -> tuple[str, ...]:
    """``--prefill``/``--decode``: comma-separated HOST:PORT."""
    return tuple(e.strip() for e in value.split(",") if e.strip())


# ---- a worker (``prefill``/``decode``) ------------------------------------------------

def connector_config(args: argparse.Namespace, worker_id: str,
                     advertise_host: str) -> ConnectorConfig:
    """The KV connector's settings: its endpoint is advertised where the worker is."""
    from pdserve.kv_transfer.config import ConnectorConfig
    from pdserve.worker.config import kv_push_default

    return ConnectorConfig(
        engine_id=worker_id, transport=args.transport,
        kv_host=args.kv_host or advertise_host,
        kv_port=args.kv_port or args.port + 1000, kv_bind_host=args.host,
        lease_s=args.lease_s, kv_checksum=args.kv_checksum,
        kv_throttle_mib_s=args.kv_throttle_mib_s, kv_stall_s=args.kv_stall_s,
        kv_link_max_age_s=args.kv_link_max_age_s, kv_handoff_lossy=args.kv_handoff_lossy,
        push=kv_push_default(args.kv_push),
        kv_offload_gib=args.kv_offload_gib, kv_disk_dir=args.kv_disk_dir,
        kv_disk_gib=args.kv_disk_gib, kv_tier_policy=args.kv_tier_policy,
        kv_store=args.kv_store, kv_store_ttl_s=args.kv_store_ttl_s,
        kv_store_timeout_s=args.kv_store_timeout_s,
        kv_store_password_file=args.kv_store_password_file,
        kv_store_admission=args.kv_store_admission,
        kv_store_tls_ca=args.kv_store_tls_ca, kv_store_tls_cert=args.kv_store_tls_cert,
        kv_store_tls_key=args.kv_store_tls_key, kv_compression=args.kv_compression,
        cluster_secret_file=args.cluster_secret_file,
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
        require_tls=args.require_tls,
    )


def lora_config(args: argparse.Namespace) -> LoraConfig:
    """From ``--enable-lora``, ``--lora-modules``, ``--max-loras``, ``--max-lora-rank``."""
    return LoraConfig(enable_lora=bool(args.enable_lora), modules=tuple(args.lora_modules or ()),
                      max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)


def engine_config(args: argparse.Namespace, model: ResolvedModel, role: Role,
                  worker_id: str, connector: ConnectorConfig) -> EngineConfig:
    """The worker's vLLM engine, from the engine flags."""
    from pdserve.worker.config import (
        kv_events_name,
        prefill_chunk_default,
        prefill_max_running_default,
        weight_transfer_backend,
    )
    from pdserve.worker.engine import EngineConfig

    return EngineConfig(
        model_path=str(model.path), served_model_name=model.served_name, role=role,
        kv_events=kv_events_name(worker_id),
        connector=connector, dtype=args.dtype, max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib, cpu_threads_bind=args.cpu_cores,
        enforce_eager=not args.compile, num_kv_blocks=args.num_kv_blocks or None,
        shm_spin_s=args.shm_spin_s,
        prefill_chunk_tokens=prefill_chunk_default(args.prefill_chunk_tokens),
        prefill_max_running=prefill_max_running_default(args.prefill_max_running),
        prefill_order=args.prefill_order, weight_version=args.weight_version,
        weight_transfer_backend=weight_transfer_backend(args.weight_transfer_backend),
        lora=lora_config(args),
    )


def worker_config(args: argparse.Namespace, model: ResolvedModel) -> WorkerConfig:
    """From the ``prefill``/``decode`` subcommand's flags (``args.command`` is the role)."""
    from pdserve.membership import check_name
    from pdserve.worker.config import WorkerConfig, default_advertise_host

    role: Role = args.command
    worker_id = check_name("worker id", args.worker_id or f"{role}-{uuid.uuid4().hex[:8]}")
    advertise = args.advertise_host or default_advertise_host(args.host)
    engine = engine_config(args, model, role, worker_id,
                           connector_config(args, worker_id, advertise))
    return WorkerConfig(worker_id, args.host, args.port, advertise, worker_membership(args),
                        engine, args.grpc_keepalive_s, args.drain_timeout_s, tls_files(args),
                        metrics_listener(args, advertise))


def sim_config(args: argparse.Namespace) -> SimConfig:
    """From the ``sim-worker`` subcommand's flags."""
    from pdserve.worker.sim.engine import SimConfig

    return SimConfig(
        role=args.role, worker_id=args.worker_id or f"sim-{args.role}-{uuid.uuid4().hex[:8]}",
        block_size=args.block_size, num_blocks=args.num_blocks,
        prefill_s_per_token=args.prefill_us_per_token * 1e-6,
        decode_s_per_token=args.decode_ms_per_token * 1e-3, lockstep=args.decode_lockstep,
        weight_version=args.weight_version, stage_weights_s=args.stage_weights_s)


# ---- ``up`` ---------------------------------------------------------------------------

def up_store(args: argparse.Namespace) -> KvStoreUp:
    """The workers' KV store flags, or ``--with-redis`` and its ``--redis-maxmemory``."""
    from pdserve.launch.up_store import KvStoreUp

    return KvStoreUp(url=args.kv_store or None, ttl_s=args.kv_store_ttl_s,
                     timeout_s=args.kv_store_timeout_s,
                     password_file=args.kv_store_password_file or None,
                     tls_ca=args.kv_store_tls_ca, tls_cert=args.kv_store_tls_cert,
                     tls_key=args.kv_store_tls_key,
                     compression=args.kv_compression, admission=args.kv_store_admission,
                     with_redis=args.with_redis,
                     redis_maxmemory=args.redis_maxmemory)


# The engine and transport flags up hands every vLLM worker as parsed: all of them but
# those up decides (the dtype, resolved once; prefill's KV blocks; each worker's disk
# folder; the weights it checks; its transport, checked against TLS; the KV store, which
# --with-redis starts and so picks the URL and password of; its other flags are checked
# against them in ``KvStoreUp``, which renders the lot).
_UP_DECIDES = ("dtype", "num-kv-blocks", "kv-disk-dir", "kv-disk-gib", "weight-version",
               "weight-transfer-backend", "transport", "kv-store", "kv-store-ttl-s",
               "kv-store-timeout-s", "kv-store-password-file", "kv-store-admission",
               "kv-store-tls-ca", "kv-store-tls-cert", "kv-store-tls-key", "kv-compression")
HANDED_TO_WORKERS = tuple(name for name in ENGINE + TRANSPORT if name not in _UP_DECIDES)
# The router flags up takes and hands its router as parsed: all but the keys (up reads
# their files and hands the keys in the router's environment, never on a command line
# that ``ps`` shows: ``EdgeConfig.env``) and the admin listener (up gives a keyed router
# one: ``up.probed_edge``).
_EDGE_UP_DECIDES = ("api-key", "api-key-file", "admin-key", "admin-key-file", "admin-port",
                    "admin-host")
HANDED_TO_ROUTER = ("placement", "kv-pool", "decode-cache", *DISAGG, *OPENAI,
                    *(name for name in EDGE if name not in _EDGE_UP_DECIDES))


def worker_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """``up``'s vLLM workers' engine, transport and LoRA flags that up does not decide,
    checked here as a worker checks them (``lora_config``: a bad adapter list fails
    before any child starts; simulated workers serve none), handed on as parsed."""
    if lora_config(args).enable_lora and args.simulated:
        raise ValueError("--enable-lora: simulated workers serve no adapters")
    return handed_on(args, HANDED_TO_WORKERS)


def router_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """``up``'s router's flags (placement, KV pool, decode cache, disaggregation, planner,
    tool calls, admission and the edge's but its keys and admin listener), checked here
    as the router checks them (a bad one fails before any child starts; the edge's by
    ``edge_config``), handed on as parsed."""
    for check in (disagg_config, planner_config, tool_config):
        check(args)
    return handed_on(args, HANDED_TO_ROUTER)


def up_config(args: argparse.Namespace, model: ResolvedModel) -> UpConfig:
    """From the ``up`` subcommand's flags; ``--dtype auto`` resolved here, once, for
    every engine (simulated workers have no dtype)."""
    from pdserve.core.dtype import resolve_dtype
    from pdserve.launch.up import UpConfig
    from pdserve.worker.config import weight_transfer_backend

    dtype = None if args.simulated else resolve_dtype(args.dtype, model_path=model.path)
    # vLLM workers need a GPU for it; simulated ones take none (UpConfig refuses it).
    transfer = args.weight_transfer_backend
    if not args.simulated:
        transfer = weight_transfer_backend(transfer)
    return UpConfig(
        model=str(model.path), dtype=dtype.dtype if dtype else args.dtype,
        dtype_choice=dtype, host=args.host, port=args.port,
        num_prefill=args.num_prefill, num_decode=args.num_decode,
        transport=args.transport, max_model_len=args.max_model_len,
        startup_timeout_s=args.startup_timeout_s,
        log_level=args.log_level,
        cpu_layout=args.cpu_layout, kv_disk_dir=args.kv_disk_dir,
        kv_disk_gib=args.kv_disk_gib,
        kv_store=up_store(args),
        etcd=args.etcd or "", with_etcd=args.with_etcd, cluster=args.cluster,
        etcd_ttl_s=args.etcd_ttl_s, etcd_auth=etcd_auth(args),
        num_kv_blocks=args.num_kv_blocks or None,
        weight_version=args.weight_version, weight_transfer_backend=transfer,
        router_flags=router_flags(args), worker_flags=worker_flags(args),
        max_restarts=args.max_restarts,
        restart_window_s=args.restart_window_s, simulated=args.simulated,
        cluster_secret_file=args.cluster_secret_file, tls=tls_files(args),
        log_format=args.log_format, edge=edge_config(args),
        worker_metrics=args.worker_metrics,
        metrics_targets_file=args.metrics_targets_file or "", log_dir=args.log_dir or "",
        router_processes=args.router_processes,
    )
