"""The ``pdserve`` command: ``up``, ``router``, ``prefill``, ``decode``, ``prepare-model``,
``health``, ``machine``, ``bench`` (a load generator: ``pdserve.cli.bench``).

Every flag also reads a ``PDSERVE_<FLAG>`` environment variable (e.g.
``PDSERVE_PORT``); flags win. Flags are declared once (``flags.py``); each
component's frozen config is built from the parsed flags in one place
(``configs.py``); this module only picks the subcommand's flags and dispatches.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pdserve.cli.parser import build_parser
from pdserve.core.logs import setup_logging
from pdserve.core.model import ResolvedModel


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command line as given: --processes re-runs it per process
    setup_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", "text"))
    try:
        return _run(args)
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _run_bench(argv: list[str]) -> int:
    """``pdserve bench``, imported only here so that starting a router or a worker does
    not import the load generator and the benchmarks."""
    from pdserve.cli.bench import main as bench_main

    return bench_main(argv)


def _run(args: argparse.Namespace) -> int:
    from pdserve.core.model import prepare_default_model, resolve_model

    if args.command == "prepare-model":
        print(prepare_default_model())
        return 0
    if args.command == "sim-worker":
        return _run_sim_worker(args)
    if args.command == "health":
        return _run_health(args)
    if args.command == "certs":
        from pdserve.core.certs import DEFAULT_HOSTS, make_test_ca

        files = make_test_ca(Path(args.out), args.host or DEFAULT_HOSTS, args.days)
        print(f"--tls-cert {files.cert} --tls-key {files.key} --tls-ca {files.ca}")
        return 0
    if args.command == "machine":
        from pdserve.core.dtype import resolve_dtype

        print(resolve_dtype(args.dtype).describe())
        return 0
    runners: dict[str, Callable[[argparse.Namespace, ResolvedModel], int]] = {
        "prefill": _run_worker, "decode": _run_worker, "router": _run_router, "up": _run_up}
    return runners[args.command](args, resolve_model(args.model))


def _run_worker(args: argparse.Namespace, model: ResolvedModel) -> int:
    import asyncio

    from pdserve.cli.configs import worker_config
    from pdserve.launch.serve_worker import serve_worker
    from pdserve.membership import create_registrar

    config = worker_config(args, model)
    asyncio.run(serve_worker(config.engine, config.worker_id, config.host, config.port,
                             create_registrar(config.membership), config.advertise_host,
                             config.grpc_keepalive_s, config.drain_timeout_s,
                             tls=config.tls.load(), metrics=config.metrics))
    return 0


def _run_router(args: argparse.Namespace, model: ResolvedModel) -> int:
    from pdserve.cli.configs import router_config
    from pdserve.router.server import run_router

    config = router_config(args, model)
    if args.processes > 1:
        from pdserve.launch.router_processes import run_router_processes

        return run_router_processes(args.argv, config, args.processes)
    run_router(config)
    return 0


def _run_up(args: argparse.Namespace, model: ResolvedModel) -> int:
    from pdserve.cli.configs import up_config
    from pdserve.launch.up import run_up

    return run_up(up_config(args, model))


def _run_health(args: argparse.Namespace) -> int:
    from pdserve.cli.configs import tls_files
    from pdserve.cli.health import probe

    result = probe(args.healthcheck, args.health_timeout_s, tls_files(args).load())
    print(result.detail, file=sys.stdout if result.healthy else sys.stderr)
    return 0 if result.healthy else 1


def _run_sim_worker(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.cli.configs import metrics_listener, sim_config, tls_files, worker_membership
    from pdserve.core.cluster_secret import optional_secret
    from pdserve.launch.sim_worker import serve_sim_worker, sim_advertise_host
    from pdserve.membership import create_registrar

    membership = worker_membership(args)
    metrics = metrics_listener(args, sim_advertise_host(args.host))
    asyncio.run(serve_sim_worker(sim_config(args), args.host, args.port,
                                 create_registrar(membership),
                                 optional_secret(args.cluster_secret_file),
                                 tls_files(args).load(),
                                 args.grpc_keepalive_s, args.drain_timeout_s, metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
