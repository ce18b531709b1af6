"""``pdserve bench <tool>``: the micro-benchmarks' flags (``pdserve.bench.micro``). Each
tool's flags become its frozen config (``pdserve.bench.micro.configs``), whose field
defaults are the flags' defaults; the tool's module is imported only to run it, so
``--help`` imports neither torch nor vLLM.

``add_tool_commands(sub)`` adds one subparser per tool; ``run_tool(args)`` builds the
chosen tool's config and runs it (exit code; a bad value: one ``error:`` line, 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from collections.abc import Callable
from typing import Any

from pdserve.bench.micro import configs, host_configs
from pdserve.cli.bench_rollout_tools import ROLLOUT_TOOLS
from pdserve.cli.bench_tool import Tool, csv_list

# Flags that mean the same in every tool that takes them, declared once; each tool's
# default is its own config's (a tool may add words to the help).
SHARED: dict[str, dict[str, Any]] = {
    "--reps": {"type": int, "help": "measured repetitions (each after a warm-up)"},
    "--dtype": {"help": "the engines' dtype (auto: float32 on CPUs without native bf16)"},
    "--max-tokens": {"type": int, "help": "output tokens per request"},
    "--port-base": {"type": int, "help": "the first of the ports the bench's processes use"},
    "--json": {"help": "also write the numbers to this file"},
    "--seed": {"type": int, "help": "random seed"},
    "--clients": {"type": int, "help": "concurrent clients"},
    "--requests": {"type": int, "help": "short requests"},
    "--long-requests": {"type": int, "help": "long requests"},
    "--long-tokens": {"type": int, "help": "output tokens of a long request"},
    "--duration-s": {"type": float, "help": "seconds of load"},
    "--deadline-s": {"type": float, "help": "a request unanswered after this long counts as hung"},
}


TOOLS: dict[str, Tool] = {
    "transfer": Tool("transfer", configs.TransferConfig,
                     "KV transfer GB/s per transport vs memcpy and a raw socket", (
        ("--transports", {"help": "comma-separated transports"}),
        ("--dtypes", {"help": "comma-separated KV dtypes"}),
        ("--tokens", {"help": "comma-separated tokens per transfer (multiples of "
                      f"{configs.TRANSFER_BLOCK_SIZE})"}),
        "--reps",
        ("--checksum", {"action": "store_true", "help": "checksum every transfer"}),
        ("--device", {"choices": ("cpu", "cuda"),
                      "help": "where both sides keep the KV (cuda: GPU memory, cuda:0)"}),
        ("--pd", {"action": "store_true",
                  "help": "also the P/D part: share of TTFT, pull vs push (real vLLM)"}),
        ("--pd-tokens", {"type": int, "help": "--pd: prompt tokens"}),
        ("--link-gbit", {"help": "comma-separated Gbit/s: the two sides on two hosts "
                         "(network namespaces, root) linked at each rate in turn"}),
    )),
    "link-aware": Tool("link_aware", host_configs.LinkAwareConfig,
                       "long prompts through a link-aware router and one that is not, on "
                       "hosts, prefill's link at each rate: TTFT and the 2nd token, on/off", (
        ("--link-gbit", {"help": "comma-separated Gbit/s of prefill's link, each in turn"}),
        ("--requests", {"type": int, "help": "requests per router and rate"}),
        ("--prompt-tokens", {"help": "comma-separated prompt lengths, in turn"}),
        ("--output-tokens", {"type": int, "help": "output tokens per request"}),
        ("--rate", {"type": float, "help": "requests per second (Poisson)"}),
        "--dtype", "--seed",
        ("--kv-cache-gib", {"type": int, "help": "each engine's KV cache, GiB"}),
        ("--kv-compression", {"choices": ("none", "lossless", "int8", "fp8"),
                              "help": "the workers' --kv-compression (lossless: a thin "
                              "path's handoffs move encoded)"}),
        ("--out", {"help": "the results' folder under bench/results (default: named "
                   "from --kv-compression and --prefills)"}),
        ("--prefills", {"type": int, "choices": (1, 2),
                        "help": "2: a second prefill behind a link at 10 Gbit/s, never "
                        "shaped: where cache_aware placement sends the long prompts"}),
        ("--request-timeout-s", {"type": float, "help": "each request's deadline"}),
        ("--log-dir", {"help": "the processes' logs"}),
    )),
    "partitions": Tool("partitions", host_configs.PartitionsConfig,
                       "network partitions on hosts under streams: the time from each heal "
                       "to a whole cluster, and the streams' answers", (
        ("--faults", {"help": "comma-separated, of " + ", ".join(host_configs.PARTITIONS)}),
        "--reps",
        ("--streams", {"type": int, "help": "streams at once through each fault"}),
        ("--prompt-tokens", {"type": int, "help": "random prompt tokens (a fresh prompt "
                             "each time)"}),
        ("--output-tokens", {"type": int, "help": "greedy tokens per stream"}),
        ("--cut-after-tokens", {"type": int, "help": "router-decode, frozen-decode: the "
                                "fault at the first stream's token"}),
        "--dtype", "--seed",
        ("--kv-cache-gib", {"type": int, "help": "each engine's KV cache, GiB"}),
        ("--link-gbit", {"type": float, "help": "every host's link"}),
        ("--pull-link-gbit", {"type": float, "help": "prefill-decode: prefill's link"}),
        ("--etcd-ttl-s", {"type": int, "help": "the workers' etcd lease TTL"}),
        ("--kv-stall-s", {"type": float, "help": "the workers' --kv-stall-s"}),
        ("--lease-s", {"type": float, "help": "the workers' --lease-s"}),
        ("--whole-timeout-s", {"type": float, "help": "the longest wait for a whole cluster"}),
        ("--request-timeout-s", {"type": float, "help": "each stream's deadline"}),
        ("--log-dir", {"help": "the processes' logs"}),
    )),
    "transfer-pd": Tool("transfer_pd", configs.TransferPdConfig,
                        "the KV transfer's share of TTFT in a real P/D run, pull vs push", (
        ("--tokens", {"type": int, "help": "prompt tokens"}),
        "--reps", "--max-tokens", "--dtype", "--port-base",
        ("--tls", {"action": "store_true",
                   "help": "also push over mutual TLS (gRPC and KV): TTFT ratio"}),
    )),
    "ttft": Tool("ttft", configs.TtftConfig,
                 "TTFT of one prompt: P/D versus two aggregated baselines", (
        "--reps",
        ("--prompt-tokens", {"type": int, "help": "tokens of each prompt, exactly"}),
        "--max-tokens", "--dtype",
        ("--port-base", {"help": "router port; workers use the next four ports"}),
    )),
    "router-cost": Tool("router_cost.parts", configs.RouterCostConfig,
                        "what the router adds per request and per streamed chunk (sim "
                        "workers)", (
        ("--requests", {"help": "(a): short requests each way"}),
        ("--long-requests", {"help": "(b): long requests each way"}),
        "--long-tokens",
        ("--clients", {"help": "(c): concurrent clients"}),
        ("--duration-s", {"help": "(c): seconds of the closed loop"}),
        ("--loop-tokens", {"type": int, "help": "(c): max_tokens per request"}),
        "--json",
        ("--profile", {"help": "py-spy the router during (c) into this file (raw collapsed "
                       "stacks: one line per stack, its sample count last)"}),
        ("--parts", {"nargs": "+", "choices": configs.ROUTER_COST_PARTS,
                     "help": "latency: (a)-(c); stream: CPU per streamed token with paced "
                     "engines, the rate per process count, vllm-router beside it; "
                     "replicas: the prefix hit rate through two routers against one"}),
        ("--replica-requests", {"type": int, "help": "replicas: requests of each of the "
                                "two clients"}),
        ("--auth", {"nargs": "+", "choices": configs.ROUTER_COST_AUTH,
                    "help": "latency: one run per entry, in order (repeat to interleave): "
                    "none, or secret (a cluster secret on every process); with both, the "
                    "router's CPU per request and per chunk side by side"}),
        ("--streams", {"type": int, "help": "stream: concurrent streams of the paced passes"}),
        ("--stream-tokens", {"type": int, "help": "stream: tokens per stream, long pass"}),
        ("--short-rounds", {"type": int, "help": "stream: rounds of 2-token streams"}),
        ("--lone-requests", {"type": int, "help": "stream: lone requests each way (added "
                             "TTFT)"}),
        ("--probe-streams", {"type": int, "help": "stream: streams straight from the "
                             "engines beside the routed ones (the engines' own ITL)"}),
        ("--ms-per-token", {"type": float, "help": "stream: the decode engines' pacing"}),
        ("--processes-list", {"type": int, "nargs": "+",
                              "help": "stream: router processes, one sweep each"}),
        ("--sweep-streams", {"type": int, "nargs": "+",
                             "help": "stream: offered streams, rising, until ITL p99 > "
                             "1.1 x the engines' own"}),
        ("--sweep-tokens", {"type": int, "help": "stream: tokens per request in the sweep"}),
        ("--sweep-window-s", {"type": float, "help": "stream: steady seconds per sweep step"}),
        ("--skip-vllm-router", {"action": "store_true",
                                "help": "stream: no vllm-router baseline"}),
        ("--lockstep", {"action": argparse.BooleanOptionalAction,
                        "help": "stream: the sim decode steps its running requests together "
                        "(a real engine's batch); --no-lockstep: each on its own timer"}),
    )),
    "metrics-overhead": Tool("metrics_overhead", configs.MetricsOverheadConfig,
                             "what the router's metrics cost: metrics on vs off (sim "
                             "workers)", (
        ("--rounds", {"type": int, "help": "rounds, each running both routers"}),
        ("--requests", {"help": "short requests per round"}),
        ("--long-requests", {"help": "long requests per round"}),
        "--long-tokens",
        ("--observe-chunks", {"type": int,
                              "help": "in-process: calls of the per-chunk metric work"}),
        ("--control", {"action": "store_true", "help": "A/A run: both routers with metrics "
                       "on; its differences are the bench's own noise and bias"}),
        "--json",
    )),
    "overload": Tool("overload", configs.OverloadConfig,
                     "admission control under open-loop overload (pdserve up --simulated)", (
        ("--rates", {"type": float, "nargs": "+",
                     "help": "offered request rates (req/s), one run each"}),
        ("--duration-s", {"help": "seconds per rate"}),
        ("--max-concurrent", {"type": int, "help": "up's --max-concurrent-requests"}),
        ("--max-queued", {"type": int, "help": "up's --max-queued-requests"}),
        ("--max-queue-wait-s", {"type": float, "help": "up's --max-queue-wait-s"}),
        ("--max-tokens", {"help": "per request (sim: 2 ms each)"}),
        "--deadline-s",
        ("--max-connections", {"type": int, "help": "the client's connection pool"}),
        "--seed",
        ("--json", {"help": "write results here (default: in the log folder)"}),
    )),
    "placement": Tool("placement.cache_aware", configs.PlacementConfig,
                      "cache-aware vs round-robin placement on real vLLM", (
        "--dtype",
        ("--max-model-len", {"type": int, "help": "the workers' and router's context"}),
        ("--num-kv-blocks", {"type": int, "help": "KV blocks (128 tokens) per prefill worker"}),
        ("--systems", {"type": int, "help": "shared-prefix: system prompts"}),
        ("--users", {"type": int, "help": "users per system prompt"}),
        ("--turns", {"type": int, "help": "turns per conversation"}),
        ("--system-words", {"type": int, "help": "words per system prompt"}),
        ("--control-systems", {"type": int, "help": "control: system prompts"}),
        ("--concurrency", {"type": int, "help": "conversations at a time"}),
        ("--max-tokens", {"help": "reply length per turn (1: prefill answers alone, "
                          "no decode)"}),
    )),
    "placement-decision": Tool("placement.decision", configs.PlacementDecisionConfig,
                               "placement decision time: many prefill workers, a large "
                               "prefix index", (
        ("--workers", {"type": int, "help": "prefill workers"}),
        ("--blocks", {"type": int, "help": "(worker, block) entries in the index"}),
        ("--decisions", {"type": int, "help": "decisions timed per policy"}),
        "--seed",
    )),
    "faults": Tool("faults", configs.FaultsConfig,
                   "a fault matrix under steady load (pdserve up --with-etcd)", (
        ("--simulated", {"action": "store_true", "help": "sim-worker processes, no vLLM"}),
        ("--faults", {"nargs": "+", "choices": configs.FAULTS, "metavar": "FAULT",
                      "help": f"faults to inject, in turn: {', '.join(configs.FAULTS)}"}),
        ("--num-prefill", {"type": int, "help": "prefill workers"}),
        ("--num-decode", {"type": int, "help": "decode workers"}),
        "--clients", "--max-tokens",
        ("--pre-s", {"type": float, "help": "load before the fault"}),
        ("--fault-s", {"type": float, "help": "load after the fault"}),
        ("--stop-s", {"type": float, "help": "stop-decode: SIGCONT after"}),
        ("--post-s", {"type": float, "help": "load after recovery"}),
        ("--recover-s", {"type": float, "help": "wait at most this long for every worker "
                         "to be healthy again"}),
        "--deadline-s",
        ("--settle-s", {"type": float, "help": "wait at most this long for the workers to "
                        "hold nothing"}),
        ("--startup-timeout-s", {"type": float, "help": "up's --startup-timeout-s"}),
        ("--json", {"help": "write results here (default: in the log folder)"}),
    )),
    **ROLLOUT_TOOLS,
    "fuzz": Tool("fuzz", configs.FuzzConfig,
                 "bad input on the KV port: random, truncated and malformed frames, ops "
                 "before the handshake, auth garbage, stalls; crashes, leaks, liveness", (
        ("--inputs", {"type": int, "help": "inputs per port"}),
        "--seed",
        ("--concurrency", {"type": int, "help": "connections at a time"}),
        ("--target", {"help": "a worker's KV port, HOST:PORT (default: two tcp transports "
                      "on fake KV in this process, one with a cluster secret)"}),
        ("--cluster-secret-file", {"help": "--target: its cluster secret"}),
        ("--idle-timeout-s", {"type": float, "help": "in process: the servers' idle "
                              "deadline, which stalled connections must hit"}),
        ("--stall-deadline-s", {"type": float, "help": "--target: its idle timeout; "
                                "stalled inputs must be dropped by it (unset: none sent)"}),
        "--json",
    )),
    "cache-sim": Tool("cache_sim.main", configs.CacheSimConfig,
                      "KV tier eviction policies' prefix-hit ratio on a Mooncake-format "
                      "trace, beside Belady's optimum and an infinite cache", (
        ("--trace", {"help": "a Mooncake-format JSONL trace (timestamp, input_length, "
                     "output_length, hash_ids)"}),
        ("--capacity-blocks", {"type": csv_list(int), "help": "comma-separated tier sizes in "
                               "blocks"}),
        ("--policy", {"type": csv_list(str), "help": "comma-separated policies (--kv-tier-policy "
                      "names, and belady, infinite)"}),
        ("--admission", {"help": "the KV store's admission (a --kv-store-admission name) in "
                         "front of every policy: a request saves only its blocks before "
                         "the first it refuses (default: all)"}),
        "--json",
    )),
    "kv-store": Tool("kv_store", configs.KvStoreConfig,
                     "the cluster KV store's SET/GET GiB/s on its values beside a memcpy of "
                     "the same bytes", (
        ("--url", {"help": "a KV store URL, redis://HOST:PORT or redis-cluster://... "
                   "(rediss:// verified against the system's roots) "
                   "(default: a local redis-server started for the run)"}),
        ("--value-mib", {"type": csv_list(float), "help": "comma-separated value sizes in MiB"}),
        ("--total-mib", {"type": int, "help": "MiB written and read per size and rep"}),
        ("--batch-mib", {"type": int, "help": "MiB per call (one round trip each)"}),
        ("--tls", {"action": "store_true", "help": "the local server over mutual TLS "
                   "(a throwaway CA): compare with a run without it for what TLS costs"}),
        "--reps", "--json",
    )),
    "kv-compression": Tool("kv_compression", configs.KvCompressionConfig,
                           "the KV store's block codecs on real KV of the default model: "
                           "ratio, encode/decode ms per MiB, lossy modes' error", (
        ("--dtypes", {"type": csv_list(str), "help": "comma-separated engine dtypes, one "
                      "capture each"}),
        ("--modes", {"type": csv_list(str), "help": "comma-separated codecs (none, lossless, "
                     "int8, fp8)"}),
        ("--prompts", {"type": int, "help": "prompts run before the capture"}),
        ("--blocks", {"type": int, "help": "full KV blocks captured per dtype"}),
        "--reps",
        ("--random", {"action": argparse.BooleanOptionalAction,
                      "help": "also random blocks of the same shape (--no-random: not)"}),
        ("--json", {"help": "write the JSON lines here (default: "
                    "bench/results/kv-compression-TIME.json)"}),
    )),
}


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _add_flags(p: argparse.ArgumentParser, tool: Tool) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(tool.config)}
    for flag in tool.flags:
        name, own = (flag, {}) if isinstance(flag, str) else flag
        kwargs = {**SHARED.get(name, {}), **own}
        default = defaults[_dest(name)]
        if kwargs.get("action") != "store_true":
            kwargs["default"] = list(default) if isinstance(default, tuple) else default
            if default is not None and "help" in kwargs:
                kwargs["help"] += " (default: %(default)s)"
        p.add_argument(name, **kwargs)


def add_tool_commands(sub: Any) -> None:
    """One ``pdserve bench <name>`` subparser per micro-benchmark, on ``sub`` (an
    ``add_subparsers`` result); each sets ``tool`` so ``run_tool`` finds it, and
    ``func`` (``run_tool``) as the other ``pdserve bench`` subcommands do."""
    for name, tool in TOOLS.items():
        p = sub.add_parser(name, help=tool.help, description=tool.help)
        _add_flags(p, tool)
        p.set_defaults(tool=name, func=run_tool)


def build_config(name: str, args: argparse.Namespace) -> Any:
    """The tool's frozen config from its parsed flags (lists become tuples); raises
    ``ValueError`` for a value the config refuses."""
    tool = TOOLS[name]
    values = {}
    for flag in tool.flags:
        dest = _dest(flag if isinstance(flag, str) else flag[0])
        value = getattr(args, dest)
        values[dest] = tuple(value) if isinstance(value, list) else value
    return tool.config(**values)


def run_tool(args: argparse.Namespace) -> int:
    """Run the tool ``args.tool`` names with its config; its exit code."""
    name: str = args.tool
    try:
        config = build_config(name, args)
    except ValueError as exc:
        print(f"pdserve bench {name}: error: {exc}", file=sys.stderr)
        return 2
    run: Callable[[Any], int] = importlib.import_module(
        f"pdserve.bench.micro.{TOOLS[name].module}").run
    return run(config)
