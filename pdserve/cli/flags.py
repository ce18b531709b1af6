"""Command-line flags, each declared once (how a flag is declared and parsed:
``flag_types.py``).

Every flag also reads ``PDSERVE_<FLAG>`` from the environment (``--kv-port`` →
``PDSERVE_KV_PORT``); a flag on the command line wins. An environment value is
parsed and checked exactly like the flag's own value, and only when it is used,
so ``PDSERVE_PORT=abc`` is the same one-line error as ``--port abc``, naming
the variable.
"""

from __future__ import annotations

from pdserve.cli.flag_types import (
    Flag,
    parse_bool,
    parse_chunk_tokens,
    parse_float,
    parse_int,
    parse_lora_modules,
    parse_lora_rank,
    parse_port,
    parse_weight_version,
)
from pdserve.cli.flags_edge import EDGE_FLAGS
from pdserve.cli.health import DEFAULT_TARGET, HealthTarget
from pdserve.core.block_hash import DEFAULT_WEIGHT_VERSION
from pdserve.core.grpc_options import DEFAULT_KEEPALIVE_S, MIN_KEEPALIVE_S
from pdserve.core.logs import DEFAULT_LOG_FORMAT, LOG_FORMATS
from pdserve.core.lora import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS
from pdserve.kv_transfer.base import transport_names
from pdserve.kv_transfer.tiers.policies.registry import (
    ADMIT_ALL,
    DEFAULT_POLICY,
    check_admission,
    check_policy,
    policy_names,
)
from pdserve.launch.cpu_layout import CPU_LAYOUTS
from pdserve.launch.supervisor import DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_WINDOW_S
from pdserve.launch.up_store import DEFAULT_REDIS_MAXMEMORY, check_maxmemory
from pdserve.membership import DEFAULT_TTL_S
from pdserve.router.dispatch.migration import DEFAULT_MAX_MIGRATIONS
from pdserve.router.dispatch.policies.disagg import (
    DEFAULT_DISAGG_MODE,
    DEFAULT_LOCAL_DECODE_MAX_RUNNING,
    DEFAULT_LOCAL_PREFILL_MAX_QUEUED_TOKENS,
    DEFAULT_LOCAL_PREFILL_MAX_TOKENS,
    DISAGG_MODES,
)
from pdserve.router.dispatch.policies.placement import DEFAULT_PLACEMENT, PLACEMENTS
from pdserve.router.dispatch.policies.planner import PLANNER_MODES
from pdserve.worker.engine import WEIGHT_TRANSFER_BACKENDS

# ---- the table ------------------------------------------------------------------------

def _log_level(text: str) -> str:
    return text.upper()


def _flags(*flags: Flag) -> dict[str, Flag]:
    return {f.name: f for f in flags}


FLAGS = _flags(
    # common
    Flag("model", "local HF model folder (default: the bundled SmolLM2-135M-Instruct, "
         "converted once)", metavar="PATH"),
    Flag("max-model-len", "longest prompt + output in tokens", 4096, parse_int(16)),
    Flag("log-level", "log level", "INFO", _log_level,
         choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")),
    Flag("log-format", "log lines as text, or one JSON object per line (json); both carry "
         "the request id of lines about a request", DEFAULT_LOG_FORMAT, choices=LOG_FORMATS),
    Flag("host", "bind address", "127.0.0.1"),
    Flag("port", "port", 8000, parse_port),
    Flag("worker-id", "this worker's id (default: <role>-<random>)"),
    Flag("grpc-keepalive-s", "gRPC keepalive between router and workers: ping every this "
         "many seconds, give up on a peer that leaves a ping unanswered as long (a hung "
         "worker fails its calls with UNAVAILABLE in about twice this)", DEFAULT_KEEPALIVE_S,
         parse_float(MIN_KEEPALIVE_S)),
    # engine (workers and up)
    Flag("dtype", "model and KV dtype (float32 for exact P/D equality)", "auto",
         choices=("auto", "float32", "bfloat16", "float16")),
    Flag("kv-cache-gib", "KV cache size per worker in GiB", 2, parse_int(1)),
    Flag("num-kv-blocks", "KV cache size in blocks (overrides --kv-cache-gib; 0: unset)",
         None, parse_int(0)),
    Flag("kv-offload-gib", "host-memory tier under the engine's KV cache, in GiB (0: off): "
         "finished requests' blocks are saved there, and a prompt whose prefix the engine "
         "evicted loads it back instead of recomputing it", 0.0, parse_float(0)),
    Flag("kv-disk-dir", "disk tier below the host tier: a folder of block files that "
         "survive restarts (with --kv-disk-gib)", None, metavar="DIR"),
    Flag("kv-disk-gib", "the disk tier's size in GiB (0: off; needs --kv-disk-dir)", 0.0,
         parse_float(0)),
    Flag("kv-tier-policy", "which block the host and disk tiers evict and admit: "
         f"{', '.join(policy_names())} (ttl:SECONDS, quota:NAME for per-tenant quotas; "
         "default: adaptive, see docs/benchmarks.md)", DEFAULT_POLICY, check_policy,
         metavar="NAME"),
    Flag("kv-store", "the cluster KV store every worker shares, below its own tiers: "
         "redis://HOST:PORT[/DB] or redis-cluster://HOST:PORT[,HOST:PORT...], over TLS "
         "rediss://... or rediss-cluster://... (the store verified against --tls-ca, "
         "--tls-cert/--tls-key presented; --require-tls refuses the plaintext ones; no "
         "password in the URL: --kv-store-password-file). Finished requests' blocks are "
         "published behind the request; a prompt's leading blocks load from it when that "
         "is faster than computing them (default: off)", None, metavar="URL"),
    Flag("kv-store-ttl-s", "how long a block published to the KV store lives there at most, "
         "in seconds (the server's memory cap may drop it sooner)", 3600.0, parse_float(1)),
    Flag("kv-store-timeout-s", "the deadline of each KV store call, in seconds: a stopped "
         "or unreachable store costs a request at most this, and the block is computed",
         0.5, parse_float(0.001)),
    Flag("kv-store-admission", "which of a finished request's new blocks are written to "
         "the KV store: all, or a --kv-tier-policy name whose admission decides (doorkeeper: "
         "a block only at its second want within a window; lookups' hits count as wants); a "
         "request writes only its blocks before the first refused one (default: all, "
         "measured: docs/benchmarks.md)", ADMIT_ALL, check_admission, metavar="NAME"),
    Flag("kv-store-password-file", "a file holding the KV store's password (Redis AUTH); "
         "never on the command line", None, metavar="FILE"),
    Flag("kv-store-tls-ca", "a rediss:// KV store: the PEM CA bundle its certificate is "
         "verified against, when not --tls-ca (neither: the system's roots)", None,
         metavar="PATH"),
    Flag("kv-store-tls-cert", "a rediss:// KV store: the PEM client certificate presented "
         "to it, when not --tls-cert (with --kv-store-tls-key)", None, metavar="PATH"),
    Flag("kv-store-tls-key", "the PEM private key of --kv-store-tls-cert", None,
         metavar="PATH"),
    Flag("kv-compression", "how KV blocks are encoded in the KV store and the KV pool "
         "(peers' host tiers): none, lossless (bit-identical), int8 or fp8 (lossy, "
         "per-block per-head scales); workers with different settings never share a block "
         "(the P/D handoff keeps raw bytes)", "none",
         choices=("none", "lossless", "int8", "fp8")),
    Flag("weight-version", "the version the weights the worker starts with serve under "
         "(vLLM's name for a model's own: default): it is in the worker's compatibility "
         "hash, its KV handles and cache names, so only workers of one version pair; give a "
         "worker started on a later checkpoint (--model) that checkpoint's version",
         DEFAULT_WEIGHT_VERSION, parse_weight_version, metavar="V"),
    Flag("weight-transfer-backend", "vLLM's weight-transfer engine, for weights a trainer "
         "pushes (EngineWeightCall init_weight_transfer_engine, update_weights): nccl or ipc "
         "(GPU only), or gloo (pdserve's, CPU tensors over a gloo group) (default: off; "
         "updates come from checkpoint folders, StageWeights and CommitWeights)", None,
         choices=WEIGHT_TRANSFER_BACKENDS),
    # LoRA adapters (vllm serve's flags; workers and up)
    Flag("enable-lora", "serve LoRA adapters: a request whose model names an adapter runs "
         "it, on prefill and decode; its KV is cached apart from the base model's and "
         "every other adapter's (vLLM's flag)", False, parse_bool, switch=True),
    Flag("lora-modules", "adapters served from the start, as vllm serve takes them: "
         "name=path (repeatable; several after one flag, or space-separated in the variable) "
         "or vLLM's JSON "
         "'{\"name\": ..., \"path\": ...}'; the router's POST /v1/load_lora_adapter adds "
         "more at run time (needs --enable-lora)", None, parse_lora_modules, repeat=True,
         metavar="NAME=PATH", several=True),
    Flag("max-loras", "the most adapters in one engine batch (vLLM's flag)",
         DEFAULT_MAX_LORAS, parse_int(1)),
    Flag("max-lora-rank", "the largest adapter rank the engine accepts (vLLM's flag: "
         "1, 8, 16, 32, 64, 128, 256, 320 or 512)", DEFAULT_MAX_LORA_RANK, parse_lora_rank),
    # KV transport
    Flag("transport", "KV transport: tcp, ucx (UCX via ucxx; UCX_* env vars apply), torch "
         "(torch.distributed p2p: NCCL/RCCL on GPU, gloo on CPU)", "tcp",
         choices=transport_names()),
    Flag("kv-checksum", "checksum every KV transfer; a mismatch fails the load and decode "
         "recomputes the prompt", False, parse_bool, switch=True),
    Flag("kv-throttle-mib-s", "pace KV sends to this many MiB/s (0: off); emulates a slow "
         "link", 0.0, parse_float(0)),
    Flag("kv-stall-s", "a KV pull whose peer sends no byte (or answers no connect) for "
         "this long fails, and decode recomputes the prompt: what a cut link or a frozen "
         "prefill costs (the whole pull's deadline is 30 s; the peer's first reply may "
         "take 5 s more, the wait for a lease its scheduler announces late)", 10.0,
         parse_float(0, strict=True)),
    Flag("kv-link-max-age-s", "how long the rate this worker measured to a KV peer (each "
         "pull of 1 MiB or more is a sample; the router prices handoffs over that path "
         "with it) is believed without a new pull from that peer", 60.0,
         parse_float(0, strict=True)),
    Flag("kv-handoff-lossy", "with a lossy --kv-compression (int8, fp8), encode P/D "
         "handoffs with it too where the path is thin enough for that to pay (off: a "
         "handoff's KV is encoded only by lossless, so its answer is one engine's)", False,
         parse_bool, switch=True),
    Flag("kv-push", "prefill pushes KV layer by layer (tcp transport) to the decode while "
         "computing; --no-kv-push: decode pulls after prefill (default: push on CUDA, pull "
         "on CPU, where the sender competes with prefill for cores)", None, parse_bool,
         switch=True),
    # membership
    Flag("etcd", "etcd endpoint for membership (default: static): http://HOST:PORT, or "
         "https://HOST:PORT for TLS verified against --tls-ca, presenting --tls-cert/--tls-key "
         "as the client certificate",
         metavar="URL"),
    Flag("cluster", "cluster name: etcd keys live under /pdserve/<cluster>/workers/",
         "default"),
    Flag("etcd-ttl-s", "lease TTL of a worker's registration (keepalive every TTL/3)",
         DEFAULT_TTL_S, parse_int(1)),
    Flag("etcd-user", "authenticate to etcd as this user (etcd's user/password auth; with "
         "--etcd-password-file)", metavar="NAME"),
    Flag("etcd-password-file", "file holding --etcd-user's password", metavar="PATH"),
    # worker
    Flag("advertise-host", "address the router and peers use to reach this worker "
         "(default: --host; when --host is 0.0.0.0, the address this machine's hostname "
         "resolves to, e.g. a container's own IP, else 127.0.0.1)"),
    Flag("kv-port", "KV transfer port (0: gRPC port + 1000)", 0, parse_port),
    Flag("kv-host", "address peers use to reach the KV port (default: --advertise-host)"),
    Flag("cpu-cores", "cores for the engine's compute threads, e.g. 0 or 0-3 (CPU only)"),
    Flag("lease-s", "how long prefill keeps a request's KV for its decode", 30.0,
         parse_float(0, strict=True)),
    Flag("prefill-chunk-tokens", "the most prompt tokens one request computes in an "
         "engine step while other requests run (vLLM's chunked prefill): a long prompt "
         "prefilled on a decode worker is spread over steps, so its streams' gaps stay "
         "short (the router's slo decision counts it); alone, a prompt is not cut. "
         "Default: 256 on CPU, no cap on GPU; 0: no cap", None, parse_chunk_tokens),
    Flag("prefill-max-running", "a prefill worker computes at most this many prompts at "
         "once; the others wait in --prefill-order, so a busy prefill finishes most "
         "prompts early instead of all late (applies whenever the worker serves prefill, "
         "a role switch included). Default: 1 on CPU, no limit on GPU; 0: no limit",
         None, parse_int(0)),
    Flag("prefill-order", "which waiting prompt a prefill worker computes next: shortest "
         "(fewest prompt tokens; none waits over 10 s first) or fifo (arrival)",
         "shortest", choices=("shortest", "fifo")),
    Flag("shm-spin-s", "how long the engine's processes busy-wait for the next message "
         "on vLLM's shared-memory queues before they sleep (seconds; default: 0 on CPU, "
         "where the compute threads need the cores, vLLM's own 1 on GPU)", None,
         parse_float(0)),
    Flag("compile", "use torch.compile (slow start on CPU; default: eager)", False,
         parse_bool, switch=True),
    Flag("metrics-port", "serve Prometheus /metrics over HTTP on this port: the engine's "
         "vllm:* metrics and the worker's pdserve:* ones (0: off)", 0, parse_port),
    Flag("metrics-host", "the /metrics listener's bind address (default: --host)"),
    Flag("drain-timeout-s", "on SIGTERM: stop taking requests (router: 503; worker: "
         "NOT_SERVING, leaves membership) and give the requests in flight this long to "
         "finish before exiting", 30.0, parse_float(0)),
    # router and up
    Flag("placement", "prefill/decode placement policy", DEFAULT_PLACEMENT,
         choices=sorted(PLACEMENTS)),
    Flag("kv-pool", "the cluster KV pool: a prefill worker may pull a prompt's leading "
         "blocks from a peer's host tier (--kv-offload-gib) instead of computing them, "
         "where the router's measured costs say it is cheaper (off: never)", "on",
         choices=("on", "off")),
    Flag("decode-cache", "the decode-side prefix cache: the router follows the decode "
         "workers' KV events too, places a conversation's next turn on the decode worker "
         "that holds its earlier turns, and lets that worker compute the new tokens itself "
         "(--disagg auto/slo) or load only the blocks it lacks (off: decode placed by load "
         "alone, as if its cache were empty)", "on", choices=("on", "off")),
    Flag("disagg", "per request: prefill remotely and hand the KV to decode (always), let "
         "decode prefill the prompt itself (never), decide from the uncached prompt "
         "length and the workers' load (auto), or from the engines' measured step times "
         "against --slo-ttft-ms / --slo-itl-ms (slo)", DEFAULT_DISAGG_MODE, choices=DISAGG_MODES),
    Flag("local-prefill-max-tokens", "auto: a prompt with at most this many tokens outside "
         "the prefill worker's prefix cache is prefilled on decode",
         DEFAULT_LOCAL_PREFILL_MAX_TOKENS, parse_int(0)),
    Flag("local-prefill-max-queued-tokens", "auto: beyond this many uncached prompt tokens "
         "queued on the prefill worker, a prompt up to this size is prefilled on a lightly "
         "loaded decode", DEFAULT_LOCAL_PREFILL_MAX_QUEUED_TOKENS, parse_int(0)),
    Flag("local-decode-max-running", "auto: a decode with at most this many running or "
         "queued requests counts as lightly loaded", DEFAULT_LOCAL_DECODE_MAX_RUNNING,
         parse_int(0)),
    Flag("slo-ttft-ms", "slo: the time-to-first-token objective the per-request choice "
         "(prefill on decode, or hand off) aims at, from the engines' measured step times; "
         "0: 3x this prompt's unloaded prefill", 0.0, parse_float(0)),
    Flag("slo-itl-ms", "slo: the inter-token objective; a prompt is prefilled on decode "
         "only if the step carrying it stays within it; 0: 2x an unloaded decode step",
         0.0, parse_float(0)),
    Flag("link-aware", "price a handoff's KV on its path, at the rate the decode worker "
         "measured its pulls from that prefill at: auto computes a long prompt on decode "
         "when moving its KV would take longer (reason slow_link); slo adds the transfer "
         "to the remote route's time to stream", True, parse_bool, switch=True),
    Flag("planner", "on: the router picks how many workers prefill and how many decode "
         "from the load it measures, flipping roles at run time (one at a time, with "
         "hysteresis), and exports pdserve:planner_desired_replicas; export: it decides "
         "and exports, an autoscaler acts (no flips); off: fixed roles. With --etcd, "
         "every router with on/export is a candidate and one elected leader decides",
         "off", choices=PLANNER_MODES),
    Flag("planner-interval-s", "planner: how often it decides", 5.0,
         parse_float(0, strict=True)),
    Flag("planner-window-s", "planner: how much of the past load it plans for", 60.0,
         parse_float(0, strict=True)),
    Flag("planner-hold-s", "planner: how long a better split must stay better before a "
         "worker is switched", 20.0, parse_float(0)),
    Flag("planner-cooldown-s", "planner: after a switch, no other for this long", 60.0,
         parse_float(0)),
    Flag("planner-demand-scale", "planner: this router sees 1/this of the cluster's "
         "requests (its replicas behind a load balancer share them evenly), so it plans for "
         "its own demand times this; --processes N multiplies it by N", 1.0,
         parse_float(1)),
    Flag("max-migrations", "a request whose decode worker fails mid-stream continues on "
         "another compatible decode worker (prompt + tokens sent, recomputed there) at most "
         "this many times; 0: a failed decode fails the request", DEFAULT_MAX_MIGRATIONS,
         parse_int(0)),
    Flag("prefill", "comma-separated prefill worker gRPC endpoints host:port", ""),
    Flag("decode", "comma-separated decode worker gRPC endpoints host:port", ""),
    Flag("workers-file", 'static workers from JSON {"prefill": [...], "decode": [...]}',
         metavar="PATH"),
    Flag("served-model-name", "model name in the OpenAI API (default: the model's)"),
    Flag("request-timeout-s", "each request's deadline, end to end (both worker calls "
         "included); a request's X-Request-Timeout header may shorten it; past it the "
         "client gets 504", 600.0, parse_float(0, strict=True)),
    Flag("log-timeline", "log each finished request's timeline (its phases' times) as one "
         "JSON line on logger pdserve.timeline (also on at --log-level DEBUG)", False,
         parse_bool, switch=True),
    Flag("tool-call-parser", "the model's tool-call format, by the name of vLLM's parser "
         "for it (hermes, llama3_json, mistral, ...), as vllm serve takes it: the router "
         "loads vLLM's parser (slower start), which constrains tool_choice required and "
         "named and reads tool calls out of the output"),
    Flag("enable-auto-tool-choice", "allow tool_choice auto (the default with tools): the "
         "model decides whether to call a tool (needs --tool-call-parser)", False,
         parse_bool, switch=True),
    Flag("disable-metrics", "turn the router's metrics off: no metric work per request or "
         "chunk, and /metrics answers 404 (to measure their cost, or where nothing scrapes)",
         False, parse_bool, switch=True),
    *EDGE_FLAGS,  # the router's HTTP edge (flags_edge.py)
    # up
    Flag("num-prefill", "prefill workers to start", 1, parse_int(0)),
    Flag("num-decode", "decode workers to start", 1, parse_int(1)),
    Flag("cpu-layout", "CPU only: engines share every core, or split them (prefill on the "
         "first half, decode on the rest); auto: split on 2+ cores, measured best under load",
         "auto",
         choices=CPU_LAYOUTS),
    Flag("worker-metrics", "give every worker a /metrics port (a free one) and print the "
         "scrape targets once ready; --no-worker-metrics: the router's only", True,
         parse_bool, switch=True),
    Flag("metrics-targets-file", "write the scrape targets (router and workers) to this "
         "file as Prometheus file_sd JSON once ready", metavar="PATH"),
    Flag("log-dir", "the folder for this run's logs, one file per process (router.log, "
         "prefill-0.log, decode-0.log, etcd.log, redis.log), made if missing; default: a "
         "new folder <cache>/logs/<date>-<time>-* per run", metavar="PATH"),
    Flag("with-etcd", "start a local etcd (the `etcd` binary) for membership; with "
         "--tls-cert/--tls-key/--tls-ca it serves only TLS and requires client certificates",
         False,
         parse_bool, switch=True),
    Flag("with-redis", "start a local redis-server (Debian's redis-server) as the workers' "
         "KV store (--kv-store is set to it): bound to 127.0.0.1, a password of its own "
         "(or --kv-store-password-file's), capped at --redis-maxmemory with allkeys-lru "
         "eviction, stopped with up; its log is redis.log in the run's log folder", False,
         parse_bool, switch=True),
    Flag("redis-maxmemory", "--with-redis: the local server's memory cap (redis "
         "maxmemory: 512mb, 2gb, ...); beyond it the least recently used blocks are evicted",
         DEFAULT_REDIS_MAXMEMORY, check_maxmemory, metavar="SIZE"),
    Flag("startup-timeout-s", "fail the start if no decode worker is ready after this many "
         "seconds (workers still starting then keep being supervised)", 600.0,
         parse_float(0, strict=True)),
    # security
    Flag("cluster-secret-file", "file holding the cluster's shared secret (at least 16 bytes; "
         "mode 600): router->worker gRPC calls and every KV connection must prove it "
         "(default: unauthenticated; up: a fresh random secret for its own cluster)",
         metavar="PATH"),
    Flag("tls-cert", "PEM certificate: a worker serves gRPC over TLS with it; the router "
         "presents it as its client certificate (with --tls-key)", metavar="PATH"),
    Flag("tls-key", "PEM private key of --tls-cert", metavar="PATH"),
    Flag("tls-ca", "PEM CA bundle: the router verifies workers against it (and uses TLS); "
         "a worker then requires client certificates it signed (mutual TLS)", metavar="PATH"),
    Flag("require-tls", "refuse to start any plaintext cluster listener or client: gRPC, KV "
         "(tcp transport only: ucx and torch move KV bytes unencrypted), etcd (https:// "
         "only) and the KV store (rediss:// only) all need TLS, mutual with "
         "--tls-cert/--tls-key/--tls-ca", False, parse_bool,
         switch=True),
    Flag("max-restarts", "a child (worker or router) that exits is restarted with back-off "
         "(1 s doubling to 30 s); after this many restarts within --restart-window-s it is "
         "given up on (up exits once the router or every decode worker is)",
         DEFAULT_MAX_RESTARTS, parse_int(0)),
    Flag("restart-window-s", "the window --max-restarts counts restarts in",
         DEFAULT_RESTART_WINDOW_S, parse_float(0, strict=True)),
    Flag("simulated", "start simulated workers (sim-worker: made-up tokens, modelled times, "
         "no vLLM) instead of vLLM ones: for router and fault tests only", False, parse_bool,
         switch=True),
    # health (container health checks)
    Flag("healthcheck", "what `pdserve health` asks: http://HOST:PORT/PATH (GET, healthy on "
         "200; the router's /health) or grpc://HOST:PORT (grpc.health.v1, healthy on "
         "SERVING; a worker)", DEFAULT_TARGET, HealthTarget.parse, metavar="URL"),
    Flag("health-timeout-s", "the probe's deadline", 5.0, parse_float(0, strict=True)),
    # simulated worker
    Flag("role", "the simulated worker's role", "prefill", choices=("prefill", "decode")),
    Flag("block-size", "tokens per KV block", 16, parse_int(1)),
    Flag("num-blocks", "simulated prefix-cache capacity in blocks", 1024, parse_int(1)),
    Flag("prefill-us-per-token", "modelled prefill time per token (µs)", 20.0, parse_float(0)),
    Flag("decode-ms-per-token", "modelled decode time per token (ms)", 2.0, parse_float(0)),
    Flag("stage-weights-s", "modelled time of a StageWeights (reading a checkpoint)",
         0.05, parse_float(0)),
    Flag("decode-lockstep", "every running decode gets its token on one shared step clock, "
         "as a real engine's batch does (default: each request on its own timer)", False,
         parse_bool, switch=True),
)
