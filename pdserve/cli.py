"""The ``pdserve`` command: ``up``, ``router``, ``prefill``, ``decode``, ``prepare-model``.

Every flag also reads a ``PDSERVE_<FLAG>`` environment variable (e.g.
``PDSERVE_PORT``); flags win. This is the one place configs are built.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from collections.abc import Sequence

from pdserve.kv_transfer.base import transport_names
from pdserve.membership import DEFAULT_TTL_S, MembershipConfig, check_name
from pdserve.model import DEFAULT_MODEL_NAME


def _env(flag: str, default: object) -> object:
    return os.environ.get("PDSERVE_" + flag.upper().replace("-", "_"), default)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=_env("model", None),
                   help=f"local HF model folder (default: {DEFAULT_MODEL_NAME}, converted once)")
    p.add_argument("--max-model-len", type=int, default=int(_env("max-model-len", 4096)))
    p.add_argument("--log-level", default=_env("log-level", "INFO"))


def _flag(value: object) -> bool:
    return str(value).lower() in ("1", "true", "yes", "on")


def _add_transport(p: argparse.ArgumentParser) -> None:
    """KV transfer flags shared by workers and ``up``."""
    p.add_argument("--transport", default=_env("transport", "tcp"), choices=transport_names(),
                   help="KV transport: tcp, ucx (UCX via ucxx; UCX_* env vars apply), "
                        "torch (torch.distributed p2p: NCCL/RCCL on GPU, gloo on CPU)")
    p.add_argument("--kv-checksum", action=argparse.BooleanOptionalAction,
                   default=_flag(_env("kv-checksum", False)),
                   help="checksum every KV transfer; a mismatch fails the load and decode "
                        "recomputes the prompt")
    p.add_argument("--kv-throttle-mib-s", type=float,
                   default=float(_env("kv-throttle-mib-s", 0.0)),
                   help="pace KV sends to this many MiB/s (0: off); emulates a slow link")
def _add_membership(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", default=_env("etcd", None), metavar="URL",
                   help="etcd endpoint http://HOST:PORT for membership (default: static)")
    p.add_argument("--cluster", default=_env("cluster", "default"),
                   help="cluster name: etcd keys live under /pdserve/<cluster>/workers/")
    p.add_argument("--etcd-ttl-s", type=int, default=int(_env("etcd-ttl-s", DEFAULT_TTL_S)),
                   help="lease TTL of a worker's registration (keepalive every TTL/3)")


def _add_worker(p: argparse.ArgumentParser, default_port: int) -> None:
    _add_common(p)
    _add_membership(p)
    p.add_argument("--advertise-host", default=_env("advertise-host", None),
                   help="address the router and peers use to reach this worker "
                        "(default: --host; 127.0.0.1 when --host is 0.0.0.0)")
    p.add_argument("--dtype", default=_env("dtype", "auto"),
                   help="auto, float32, bfloat16, float16 (float32 for exact P/D equality)")
    p.add_argument("--host", default=_env("host", "127.0.0.1"), help="gRPC bind address")
    p.add_argument("--port", type=int, default=int(_env("port", default_port)), help="gRPC port")
    p.add_argument("--kv-port", type=int, default=int(_env("kv-port", 0)),
                   help="KV transfer port (default: gRPC port + 1000)")
    p.add_argument("--kv-host", default=_env("kv-host", None),
                   help="address peers use to reach the KV port (default: --advertise-host)")
    _add_transport(p)
    p.add_argument("--kv-cache-gib", type=int, default=int(_env("kv-cache-gib", 2)))
    p.add_argument("--cpu-cores", default=_env("cpu-cores", None),
                   help="cores for the engine's compute threads, e.g. 0 or 0-3 (CPU only)")
    p.add_argument("--lease-s", type=float, default=float(_env("lease-s", 30.0)),
                   help="how long prefill keeps a request's KV for its decode")
    p.add_argument("--worker-id", default=_env("worker-id", None))
    p.add_argument("--num-kv-blocks", type=int, default=_env("num-kv-blocks", None),
                   help="KV cache size in blocks (overrides --kv-cache-gib)")
    p.add_argument("--compile", action="store_true",
                   help="use torch.compile (slow start on CPU; default: eager)")
    _add_kv_push(p)


def _add_kv_push(p: argparse.ArgumentParser) -> None:
    env = _env("kv-push", None)
    p.add_argument("--kv-push", action=argparse.BooleanOptionalAction,
                   default=None if env is None else _flag(env),
                   help="prefill pushes KV layer by layer (tcp transport) to the decode while "
                        "computing; --no-kv-push: decode pulls after prefill (default: push on "
                        "CUDA, pull on CPU, where the sender competes with prefill for cores)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="router + prefill + decode workers on this machine")
    _add_common(up)
    up.add_argument("--dtype", default=_env("dtype", "auto"))
    up.add_argument("--host", default=_env("host", "127.0.0.1"))
    up.add_argument("--port", type=int, default=int(_env("port", 8000)))
    up.add_argument("--num-prefill", type=int, default=int(_env("num-prefill", 1)))
    up.add_argument("--num-decode", type=int, default=int(_env("num-decode", 1)))
    _add_transport(up)
    up.add_argument("--kv-cache-gib", type=int, default=int(_env("kv-cache-gib", 2)))
    up.add_argument("--placement", default=_env("placement", "cache_aware"),
                    help="prefill/decode placement policy: cache_aware, least_loaded, "
                    "round_robin")
    up.add_argument("--num-kv-blocks", type=int, default=_env("num-kv-blocks", None),
                    help="KV blocks per prefill worker (overrides --kv-cache-gib; for tests "
                    "and benchmarks)")
    up.add_argument("--cpu-layout", default=_env("cpu-layout", "shared"),
                    choices=("shared", "split"),
                    help="CPU only: engines share all cores (default) or split them")
    _add_kv_push(up)
    _add_membership(up)
    up.add_argument("--with-etcd", action="store_true",
                    default=str(_env("with-etcd", "")).lower() in ("1", "true", "yes"),
                    help="start a local etcd (the `etcd` binary) for membership")
    up.add_argument("--startup-timeout-s", type=float, default=float(_env("startup-timeout-s",
                                                                          600)))

    router = sub.add_parser("router", help="the OpenAI-compatible HTTP router")
    _add_common(router)
    router.add_argument("--host", default=_env("host", "127.0.0.1"))
    router.add_argument("--port", type=int, default=int(_env("port", 8000)))
    router.add_argument("--prefill", default=_env("prefill", ""),
                        help="comma-separated prefill worker gRPC endpoints host:port")
    router.add_argument("--decode", default=_env("decode", ""),
                        help="comma-separated decode worker gRPC endpoints host:port")
    router.add_argument("--workers-file", default=_env("workers-file", None),
                        help='static workers from JSON {"prefill": [...], "decode": [...]}')
    _add_membership(router)
    router.add_argument("--placement", default=_env("placement", "cache_aware"),
                        help="cache_aware, least_loaded or round_robin")
    router.add_argument("--served-model-name", default=_env("served-model-name", None))

    _add_worker(sub.add_parser("prefill", help="a prefill worker (vLLM engine + gRPC)"), 50051)
    _add_worker(sub.add_parser("decode", help="a decode worker (vLLM engine + gRPC)"), 50061)
    sub.add_parser("prepare-model", help=f"convert the default model ({DEFAULT_MODEL_NAME}) once")
    _add_sim_worker(sub.add_parser("sim-worker", help="a simulated worker (same gRPC service; "
                                   "modelled times and prefix cache) for router-scale tests"))
    return parser


def _add_sim_worker(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", default=_env("role", "prefill"), choices=("prefill", "decode"))
    p.add_argument("--host", default=_env("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(_env("port", 50051)))
    p.add_argument("--worker-id", default=_env("worker-id", None))
    p.add_argument("--block-size", type=int, default=int(_env("block-size", 16)))
    p.add_argument("--num-blocks", type=int, default=int(_env("num-blocks", 1024)),
                   help="simulated prefix-cache capacity in blocks")
    p.add_argument("--prefill-us-per-token", type=float,
                   default=float(_env("prefill-us-per-token", 20.0)))
    p.add_argument("--decode-ms-per-token", type=float,
                   default=float(_env("decode-ms-per-token", 2.0)))
    p.add_argument("--log-level", default=_env("log-level", "INFO"))


def _kv_push_default(flag: bool | None) -> bool:
    """Measured (bench/transfer_pd.py, 2 CPU cores): push hides the transfer but its
    sender thread slows the prefill it overlaps, so it is on only with a GPU."""
    if flag is not None:
        return flag
    import torch

    return bool(torch.cuda.is_available())


def _endpoints(value: str) -> tuple[str, ...]:
    return tuple(e.strip() for e in value.split(",") if e.strip())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return _run(args)
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _run(args: argparse.Namespace) -> int:
    from pdserve.model import prepare_default_model, resolve_model

    if args.command == "prepare-model":
        print(prepare_default_model())
        return 0
    if args.command == "sim-worker":
        return _run_sim_worker(args)
    model = resolve_model(args.model)
    if args.command in ("prefill", "decode"):
        import asyncio

        from pdserve.kv_transfer.config import ConnectorConfig
        from pdserve.membership import create_registrar
        from pdserve.worker.engine import EngineConfig
        from pdserve.worker.serve import serve_worker

        worker_id = check_name("worker id", args.worker_id or
                               f"{args.command}-{uuid.uuid4().hex[:8]}")
        membership = MembershipConfig.from_flags(args.etcd, args.cluster, args.etcd_ttl_s)
        advertise = args.advertise_host or (
            args.host if args.host not in ("0.0.0.0", "::") else "127.0.0.1")
        connector = ConnectorConfig(
            engine_id=worker_id, transport=args.transport,
            kv_host=args.kv_host or advertise,
            kv_port=args.kv_port or args.port + 1000, kv_bind_host=args.host,
            lease_s=args.lease_s, kv_checksum=args.kv_checksum,
            kv_throttle_mib_s=args.kv_throttle_mib_s, push=_kv_push_default(args.kv_push),
        )
        from pdserve.prefill_worker.vllm_kv_events import KvEventEndpoints

        events = KvEventEndpoints.for_worker(f"{worker_id}-{os.getpid()}")
        config = EngineConfig(
            model_path=str(model.path), served_model_name=model.served_name, role=args.command,
            kv_events=(events.pub, events.replay) if args.command == "prefill" else None,
            connector=connector, dtype=args.dtype, max_model_len=args.max_model_len,
            kv_cache_gib=args.kv_cache_gib, cpu_threads_bind=args.cpu_cores,
            enforce_eager=not args.compile,
            num_kv_blocks=int(args.num_kv_blocks) if args.num_kv_blocks else None,
        )
        asyncio.run(serve_worker(config, worker_id, args.host, args.port,
                                 create_registrar(membership), advertise))
        return 0
    if args.command == "router":
        from pdserve.router.server import RouterConfig, run_router

        run_router(RouterConfig(
            model_path=str(model.path), served_model_name=args.served_model_name or
            model.served_name, prefill=_endpoints(args.prefill), decode=_endpoints(args.decode),
            host=args.host, port=args.port, max_model_len=args.max_model_len,
            placement=args.placement,
            membership=MembershipConfig.from_flags(
                args.etcd, args.cluster, args.etcd_ttl_s, _endpoints(args.prefill),
                _endpoints(args.decode), args.workers_file),
        ))
        return 0
    from pdserve.up import UpConfig, run_up

    return run_up(UpConfig(
        model=str(model.path), dtype=args.dtype, host=args.host, port=args.port,
        num_prefill=args.num_prefill, num_decode=args.num_decode, transport=args.transport,
        max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
        placement=args.placement, startup_timeout_s=args.startup_timeout_s,
        log_level=args.log_level, cpu_layout=args.cpu_layout, kv_checksum=args.kv_checksum,
        kv_throttle_mib_s=args.kv_throttle_mib_s, kv_push=args.kv_push, etcd=args.etcd or "",
        with_etcd=args.with_etcd, cluster=args.cluster, etcd_ttl_s=args.etcd_ttl_s,
        num_kv_blocks=int(args.num_kv_blocks) if args.num_kv_blocks else None,
    ))


def _run_sim_worker(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.sim_engine import SimConfig
    from pdserve.sim_worker import serve_sim_worker

    config = SimConfig(
        role=args.role, worker_id=args.worker_id or f"sim-{args.role}-{uuid.uuid4().hex[:8]}",
        block_size=args.block_size, num_blocks=args.num_blocks,
        prefill_s_per_token=args.prefill_us_per_token * 1e-6,
        decode_s_per_token=args.decode_ms_per_token * 1e-3)
    asyncio.run(serve_sim_worker(config, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
