"""The ``pdserve`` command line's parser: which flags each subcommand takes (flags are
declared once, in ``flags.py``), built without importing what the commands run.
``pdserve bench`` has its own parser (``bench.py``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from pdserve.cli.flag_types import Flag, FlagParser, HelpFormatter, parse_int, parse_names
from pdserve.cli.flags import FLAGS
from pdserve.core.model import DEFAULT_MODEL_NAME
from pdserve.core.version import version

DESCRIPTION = ("disaggregated prefill/decode LLM serving on vLLM. Every flag also reads "
               "a PDSERVE_<FLAG> environment variable (e.g. PDSERVE_PORT); flags win.")

# Flags by concern; a subcommand takes the groups it needs.
COMMON = ("model", "max-model-len", "log-level", "log-format")
ENGINE = ("dtype", "kv-cache-gib", "num-kv-blocks", "kv-offload-gib", "kv-disk-dir",
          "kv-disk-gib", "kv-tier-policy", "shm-spin-s", "prefill-chunk-tokens",
          "prefill-max-running", "prefill-order", "weight-version", "weight-transfer-backend",
          "kv-store", "kv-store-ttl-s", "kv-store-timeout-s", "kv-store-password-file",
          "kv-store-admission", "kv-store-tls-ca", "kv-store-tls-cert", "kv-store-tls-key",
          "kv-compression", "enable-lora", "lora-modules", "max-loras", "max-lora-rank")
TRANSPORT = ("transport", "kv-checksum", "kv-throttle-mib-s", "kv-stall-s",
             "kv-link-max-age-s", "kv-handoff-lossy", "kv-push")
MEMBERSHIP = ("etcd", "cluster", "etcd-ttl-s", "etcd-user", "etcd-password-file")
WORKER = ("host", "port", "advertise-host", "kv-port", "kv-host", "cpu-cores", "lease-s",
          "worker-id", "compile", "grpc-keepalive-s", "drain-timeout-s", "metrics-port",
          "metrics-host")
DISAGG = ("disagg", "local-prefill-max-tokens", "local-prefill-max-queued-tokens",
          "local-decode-max-running", "slo-ttft-ms", "slo-itl-ms", "link-aware", "planner",
          "planner-interval-s", "planner-window-s", "planner-hold-s", "planner-cooldown-s",
          "planner-demand-scale")
OPENAI = ("tool-call-parser", "enable-auto-tool-choice")
EDGE = ("api-key", "api-key-file", "admin-port", "admin-host", "admin-key", "admin-key-file",
        "weight-transfer-backend", "weight-transfer-allow",
        "max-concurrent-requests", "max-queued-requests", "max-queue-wait-s", "max-body-bytes",
        "drain-timeout-s", "tenant-isolation", "tenant-limits-share")
ROUTER = ("host", "port", "prefill", "decode", "workers-file", "placement", "kv-pool",
          "decode-cache",
          "served-model-name", "log-timeline", "disable-metrics", "max-migrations",
          "request-timeout-s", "grpc-keepalive-s", "processes", "reuse-port", "tenant-ledger",
          "weight-board") + DISAGG + EDGE + OPENAI
UP = ("host", "port", "num-prefill", "num-decode", "placement", "kv-pool", "decode-cache",
      "cpu-layout",
      "with-etcd", "with-redis", "redis-maxmemory",
      "startup-timeout-s", "max-restarts", "restart-window-s", "simulated", "worker-metrics",
      "metrics-targets-file", "log-dir", "router-processes") + DISAGG + EDGE + OPENAI
# The cluster secret: the router, every worker and up (which hands it to its children).
SECURITY = ("cluster-secret-file", "tls-cert", "tls-key", "tls-ca", "require-tls")
SIM = ("role", "host", "port", "worker-id", "block-size", "num-blocks",
       "prefill-us-per-token", "decode-ms-per-token", "decode-lockstep", "log-level", "log-format",
       "grpc-keepalive-s", "drain-timeout-s", "metrics-port", "metrics-host",
       "weight-version", "stage-weights-s") + MEMBERSHIP

# `pdserve certs`' own; its --host, the certificate's names, is not the bind address that
# PDSERVE_HOST sets in a deployment.
CERTS = (
    Flag("out", "folder for ca.pem, cert.pem, key.pem", metavar="DIR", required=True),
    Flag("host", "a host name or IP address the certificate is valid for (repeat; the "
         "environment variable may hold several, comma-separated; default: 127.0.0.1 and "
         "localhost)", parse=parse_names, repeat=True, metavar="NAME",
         env_var="PDSERVE_CERTS_HOST"),
    Flag("days", "validity in days", 30, parse_int(1)),
)

_HTTP = {"host": {"help": "the router's HTTP bind address"},
         "port": {"help": "the router's HTTP port"}}
_ROUTER_TRANSFER = {"weight-transfer-backend": {
    "help": "the workers' vLLM weight-transfer engine (nccl, ipc): turns on the admin "
            "routes that pass a trainer's calls to it (init_weight_transfer_engine, "
            "update_weights, ...; off: 404), their addresses held to "
            "--weight-transfer-allow"}}
_GRPC = {"host": {"help": "gRPC bind address"}}


def _command(sub: Any, name: str, help: str, names: Sequence[str],
             overrides: dict[str, dict[str, Any]] | None = None) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=help, formatter_class=HelpFormatter)
    for flag in dict.fromkeys(names):  # a name in two groups is added once
        FLAGS[flag].add_to(parser, **(overrides or {}).get(flag, {}))
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="pdserve", description=DESCRIPTION,
                        formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _command(sub, "up", "router + prefill + decode workers on this machine",
             COMMON + ENGINE + TRANSPORT + MEMBERSHIP + UP + SECURITY,
             dict(_HTTP, **{"num-kv-blocks": {"help": "KV blocks per prefill worker "
                                              "(overrides --kv-cache-gib; 0: unset)"}}))
    _command(sub, "router", "the OpenAI-compatible HTTP router",
             COMMON + ROUTER + MEMBERSHIP + SECURITY, dict(_HTTP, **_ROUTER_TRANSFER))
    for role, port in (("prefill", 50051), ("decode", 50061)):
        _command(sub, role, f"a {role} worker (vLLM engine + gRPC)",
                 COMMON + ENGINE + TRANSPORT + MEMBERSHIP + WORKER + SECURITY,
                 dict(_GRPC, port={"default": port, "help": "gRPC port"}))
    # Parsed by pdserve.cli.bench (its own parser, its flags declared as these are): listed
    # here for --help, dispatched in main() before this parser sees the arguments.
    sub.add_parser("bench", help="load-generator benchmarks against any OpenAI-compatible "
                   "endpoint (run, sweep); see `pdserve bench --help`", add_help=False)
    sub.add_parser("prepare-model", help=f"convert the default model ({DEFAULT_MODEL_NAME}) once")
    _command(sub, "health", "probe a router (HTTP /health) or a worker (gRPC health) once: "
             "exit 0 when healthy, 1 when not (container health checks)",
             ("healthcheck", "health-timeout-s", "tls-cert", "tls-key", "tls-ca"))
    certs = sub.add_parser("certs", help="a throwaway CA and one certificate it signed, for "
                           "--tls-cert/--tls-key/--tls-ca on every process of a test or compose "
                           "cluster", formatter_class=HelpFormatter)
    for flag in CERTS:
        flag.add_to(certs)
    _command(sub, "machine", "this machine's CPU, cores and the flags that decide the "
             "engines' speed, and the dtype --dtype resolves to here", ("dtype",))
    _command(sub, "sim-worker", "a simulated worker (same gRPC service; modelled times and "
             "prefix cache) for router-scale tests", SIM + SECURITY,
             dict(_GRPC, port={"default": 50051, "help": "gRPC port"}))
    return parser
