"""``pdserve bench <tool>``: the micro-benchmarks' flags (``pdserve.bench.micro``),
declared as every flag is (``bench_tool.py``). Each tool's flags become its frozen config
(``pdserve.bench.micro.configs``), whose field defaults are the flags' defaults; the
tool's module is imported only to run it, so ``--help`` imports neither torch nor vLLM.

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
from pdserve.cli.bench_tool import Tool, csv_list, shared
from pdserve.cli.flag_types import (
    Flag,
    HelpFormatter,
    parse_bool,
    parse_integer,
    parse_number,
    parse_words,
)

TOOLS: dict[str, Tool] = {
    "transfer": Tool("transfer", configs.TransferConfig,
                     "KV transfer GB/s per transport vs memcpy and a raw socket", (
        Flag("transports", help="comma-separated transports"),
        Flag("dtypes", help="comma-separated KV dtypes"),
        Flag("tokens", help="comma-separated tokens per transfer (multiples of "
             f"{configs.TRANSFER_BLOCK_SIZE})"),
        shared("reps"),
        Flag("checksum", store_true=True, help="checksum every transfer"),
        Flag("device", choices=("cpu", "cuda"),
             help="where both sides keep the KV (cuda: GPU memory, cuda:0)"),
        Flag("pd", store_true=True,
             help="also the P/D part: share of TTFT, pull vs push (real vLLM)"),
        Flag("pd-tokens", parse=parse_integer, help="--pd: prompt tokens"),
        Flag("link-gbit", help="comma-separated Gbit/s: the two sides on two hosts "
             "(network namespaces, root) linked at each rate in turn"),
    )),
    "link-aware": Tool("link_aware", host_configs.LinkAwareConfig,
                       "long prompts through a link-aware router and one that is not, on "
                       "hosts, prefill's link at each rate: TTFT and the 2nd token, on/off", (
        Flag("link-gbit", help="comma-separated Gbit/s of prefill's link, each in turn"),
        shared("requests", parse=parse_integer, help="requests per router and rate"),
        Flag("prompt-tokens", help="comma-separated prompt lengths, in turn"),
        Flag("output-tokens", parse=parse_integer, help="output tokens per request"),
        Flag("rate", parse=parse_number, help="requests per second (Poisson)"),
        shared("dtype"), shared("seed"),
        Flag("kv-cache-gib", parse=parse_integer, help="each engine's KV cache, GiB"),
        Flag("kv-compression", choices=("none", "lossless", "int8", "fp8"),
             help="the workers' --kv-compression (lossless: a thin "
             "path's handoffs move encoded)"),
        Flag("out", help="the results' folder under bench/results (default: named "
             "from --kv-compression and --prefills)"),
        Flag("prefills", parse=parse_integer, choices=(1, 2),
             help="2: a second prefill behind a link at 10 Gbit/s, never "
             "shaped: where cache_aware placement sends the long prompts"),
        Flag("request-timeout-s", parse=parse_number, help="each request's deadline"),
        Flag("log-dir", help="the processes' logs"),
    )),
    "partitions": Tool("partitions", host_configs.PartitionsConfig,
                       "network partitions on hosts under streams: the time from each heal "
                       "to a whole cluster, and the streams' answers", (
        Flag("faults", help="comma-separated, of " + ", ".join(host_configs.PARTITIONS)),
        shared("reps"),
        Flag("streams", parse=parse_integer, help="streams at once through each fault"),
        Flag("prompt-tokens", parse=parse_integer, help="random prompt tokens (a fresh prompt "
             "each time)"),
        Flag("output-tokens", parse=parse_integer, help="greedy tokens per stream"),
        Flag("cut-after-tokens", parse=parse_integer, help="router-decode, frozen-decode: the "
             "fault at the first stream's token"),
        shared("dtype"), shared("seed"),
        Flag("kv-cache-gib", parse=parse_integer, help="each engine's KV cache, GiB"),
        Flag("link-gbit", parse=parse_number, help="every host's link"),
        Flag("pull-link-gbit", parse=parse_number, help="prefill-decode: prefill's link"),
        Flag("etcd-ttl-s", parse=parse_integer, help="the workers' etcd lease TTL"),
        Flag("kv-stall-s", parse=parse_number, help="the workers' --kv-stall-s"),
        Flag("lease-s", parse=parse_number, help="the workers' --lease-s"),
        Flag("whole-timeout-s", parse=parse_number, help="the longest wait for a whole cluster"),
        Flag("request-timeout-s", parse=parse_number, help="each stream's deadline"),
        Flag("log-dir", help="the processes' logs"),
    )),
    "transfer-pd": Tool("transfer_pd", configs.TransferPdConfig,
                        "the KV transfer's share of TTFT in a real P/D run, pull vs push", (
        Flag("tokens", parse=parse_integer, help="prompt tokens"),
        shared("reps"), shared("max-tokens"), shared("dtype"), shared("port-base"),
        Flag("tls", store_true=True,
             help="also push over mutual TLS (gRPC and KV): TTFT ratio"),
    )),
    "ttft": Tool("ttft", configs.TtftConfig,
                 "TTFT of one prompt: P/D versus two aggregated baselines", (
        shared("reps"),
        Flag("prompt-tokens", parse=parse_integer, help="tokens of each prompt, exactly"),
        shared("max-tokens"), shared("dtype"),
        shared("port-base", help="router port; workers use the next four ports"),
    )),
    "router-cost": Tool("router_cost.parts", configs.RouterCostConfig,
                        "what the router adds per request and per streamed chunk (sim "
                        "workers)", (
        shared("requests", help="(a): short requests each way"),
        shared("long-requests", help="(b): long requests each way"),
        shared("long-tokens"),
        shared("clients", help="(c): concurrent clients"),
        shared("duration-s", help="(c): seconds of the closed loop"),
        Flag("loop-tokens", parse=parse_integer, help="(c): max_tokens per request"),
        shared("json"),
        Flag("profile", help="py-spy the router during (c) into this file (raw collapsed "
             "stacks: one line per stack, its sample count last)"),
        Flag("parts", several=True, parse=parse_words(str), choices=configs.ROUTER_COST_PARTS,
             help="latency: (a)-(c); stream: CPU per streamed token with paced "
             "engines, the rate per process count, vllm-router beside it; "
             "replicas: the prefix hit rate through two routers against one"),
        Flag("replica-requests", parse=parse_integer, help="replicas: requests of each of the "
             "two clients"),
        Flag("auth", several=True, parse=parse_words(str), choices=configs.ROUTER_COST_AUTH,
             help="latency: one run per entry, in order (repeat to interleave): "
             "none, or secret (a cluster secret on every process); with both, the "
             "router's CPU per request and per chunk side by side"),
        Flag("streams", parse=parse_integer, help="stream: concurrent streams of the paced passes"),
        Flag("stream-tokens", parse=parse_integer, help="stream: tokens per stream, long pass"),
        Flag("short-rounds", parse=parse_integer, help="stream: rounds of 2-token streams"),
        Flag("lone-requests", parse=parse_integer, help="stream: lone requests each way (added "
             "TTFT)"),
        Flag("probe-streams", parse=parse_integer, help="stream: streams straight from the "
             "engines beside the routed ones (the engines' own ITL)"),
        Flag("ms-per-token", parse=parse_number, help="stream: the decode engines' pacing"),
        Flag("processes-list", parse=parse_words(parse_integer), several=True,
             help="stream: router processes, one sweep each"),
        Flag("sweep-streams", parse=parse_words(parse_integer), several=True,
             help="stream: offered streams, rising, until ITL p99 > "
             "1.1 x the engines' own"),
        Flag("sweep-tokens", parse=parse_integer, help="stream: tokens per request in the sweep"),
        Flag("sweep-window-s", parse=parse_number, help="stream: steady seconds per sweep step"),
        Flag("skip-vllm-router", store_true=True,
             help="stream: no vllm-router baseline"),
        Flag("lockstep", switch=True, parse=parse_bool,
             help="stream: the sim decode steps its running requests together "
             "(a real engine's batch); --no-lockstep: each on its own timer"),
    )),
    "metrics-overhead": Tool("metrics_overhead", configs.MetricsOverheadConfig,
                             "what the router's metrics cost: metrics on vs off (sim "
                             "workers)", (
        Flag("rounds", parse=parse_integer, help="rounds, each running both routers"),
        shared("requests", help="short requests per round"),
        shared("long-requests", help="long requests per round"),
        shared("long-tokens"),
        Flag("observe-chunks", parse=parse_integer,
             help="in-process: calls of the per-chunk metric work"),
        Flag("control", store_true=True, help="A/A run: both routers with metrics on; its "
             "differences are the bench's own noise and bias"),
        shared("json"),
    )),
    "overload": Tool("overload", configs.OverloadConfig,
                     "admission control under open-loop overload (pdserve up --simulated)", (
        Flag("rates", parse=parse_words(parse_number), several=True,
             help="offered request rates (req/s), one run each"),
        shared("duration-s", help="seconds per rate"),
        Flag("max-concurrent", parse=parse_integer, help="up's --max-concurrent-requests"),
        Flag("max-queued", parse=parse_integer, help="up's --max-queued-requests"),
        Flag("max-queue-wait-s", parse=parse_number, help="up's --max-queue-wait-s"),
        shared("max-tokens", help="per request (sim: 2 ms each)"),
        shared("deadline-s"),
        Flag("max-connections", parse=parse_integer, help="the client's connection pool"),
        shared("seed"),
        shared("json", help="write results here (default: in the log folder)"),
    )),
    "placement": Tool("placement.cache_aware", configs.PlacementConfig,
                      "cache-aware vs round-robin placement on real vLLM", (
        shared("dtype"),
        Flag("max-model-len", parse=parse_integer, help="the workers' and router's context"),
        Flag("num-kv-blocks", parse=parse_integer,
             help="KV blocks (128 tokens) per prefill worker"),
        Flag("systems", parse=parse_integer, help="shared-prefix: system prompts"),
        Flag("users", parse=parse_integer, help="users per system prompt"),
        Flag("turns", parse=parse_integer, help="turns per conversation"),
        Flag("system-words", parse=parse_integer, help="words per system prompt"),
        Flag("control-systems", parse=parse_integer, help="control: system prompts"),
        Flag("concurrency", parse=parse_integer, help="conversations at a time"),
        shared("max-tokens", help="reply length per turn (1: prefill answers alone, "
               "no decode)"),
    )),
    "placement-decision": Tool("placement.decision", configs.PlacementDecisionConfig,
                               "placement decision time: many prefill workers, a large "
                               "prefix index", (
        Flag("workers", parse=parse_integer, help="prefill workers"),
        Flag("blocks", parse=parse_integer, help="(worker, block) entries in the index"),
        Flag("decisions", parse=parse_integer, help="decisions timed per policy"),
        shared("seed"),
    )),
    "faults": Tool("faults", configs.FaultsConfig,
                   "a fault matrix under steady load (pdserve up --with-etcd)", (
        Flag("simulated", store_true=True, help="sim-worker processes, no vLLM"),
        Flag("faults", several=True, parse=parse_words(str), choices=configs.FAULTS,
             metavar="FAULT",
             help=f"faults to inject, in turn: {', '.join(configs.FAULTS)}"),
        Flag("num-prefill", parse=parse_integer, help="prefill workers"),
        Flag("num-decode", parse=parse_integer, help="decode workers"),
        shared("clients"), shared("max-tokens"),
        Flag("pre-s", parse=parse_number, help="load before the fault"),
        Flag("fault-s", parse=parse_number, help="load after the fault"),
        Flag("stop-s", parse=parse_number, help="stop-decode: SIGCONT after"),
        Flag("post-s", parse=parse_number, help="load after recovery"),
        Flag("recover-s", parse=parse_number, help="wait at most this long for every worker "
             "to be healthy again"),
        shared("deadline-s"),
        Flag("settle-s", parse=parse_number, help="wait at most this long for the workers to "
             "hold nothing"),
        Flag("startup-timeout-s", parse=parse_number, help="up's --startup-timeout-s"),
        shared("json", help="write results here (default: in the log folder)"),
    )),
    **ROLLOUT_TOOLS,
    "fuzz": Tool("fuzz", configs.FuzzConfig,
                 "bad input on the KV port: random, truncated and malformed frames, ops "
                 "before the handshake, auth garbage, stalls; crashes, leaks, liveness", (
        Flag("inputs", parse=parse_integer, help="inputs per port"),
        shared("seed"),
        Flag("concurrency", parse=parse_integer, help="connections at a time"),
        Flag("target", help="a worker's KV port, HOST:PORT (default: two tcp transports "
             "on fake KV in this process, one with a cluster secret)"),
        Flag("cluster-secret-file", help="--target: its cluster secret"),
        Flag("idle-timeout-s", parse=parse_number, help="in process: the servers' idle "
             "deadline, which stalled connections must hit"),
        Flag("stall-deadline-s", parse=parse_number, help="--target: its idle timeout; "
             "stalled inputs must be dropped by it (unset: none sent)"),
        shared("json"),
    )),
    "cache-sim": Tool("cache_sim.main", configs.CacheSimConfig,
                      "KV tier eviction policies' prefix-hit ratio on a Mooncake-format "
                      "trace, beside Belady's optimum and an infinite cache", (
        Flag("trace", help="a Mooncake-format JSONL trace (timestamp, input_length, "
             "output_length, hash_ids)"),
        Flag("capacity-blocks", parse=csv_list(int), help="comma-separated tier sizes in "
             "blocks"),
        Flag("policy", parse=csv_list(str), help="comma-separated policies (--kv-tier-policy "
             "names, and belady, infinite)"),
        Flag("admission", help="the KV store's admission (a --kv-store-admission name) in "
             "front of every policy: a request saves only its blocks before "
             "the first it refuses (default: all)"),
        shared("json"),
    )),
    "kv-store": Tool("kv_store", configs.KvStoreConfig,
                     "the cluster KV store's SET/GET GiB/s on its values beside a memcpy of "
                     "the same bytes", (
        Flag("url", help="a KV store URL, redis://HOST:PORT or redis-cluster://... "
             "(rediss:// verified against the system's roots) "
             "(default: a local redis-server started for the run)"),
        Flag("value-mib", parse=csv_list(float), help="comma-separated value sizes in MiB"),
        Flag("total-mib", parse=parse_integer, help="MiB written and read per size and rep"),
        Flag("batch-mib", parse=parse_integer, help="MiB per call (one round trip each)"),
        Flag("tls", store_true=True, help="the local server over mutual TLS "
             "(a throwaway CA): compare with a run without it for what TLS costs"),
        shared("reps"), shared("json"),
    )),
    "kv-compression": Tool("kv_compression", configs.KvCompressionConfig,
                           "the KV store's block codecs on real KV of the default model: "
                           "ratio, encode/decode ms per MiB, lossy modes' error", (
        Flag("dtypes", parse=csv_list(str), help="comma-separated engine dtypes, one "
             "capture each"),
        Flag("modes", parse=csv_list(str), help="comma-separated codecs (none, lossless, "
             "int8, fp8)"),
        Flag("prompts", parse=parse_integer, help="prompts run before the capture"),
        Flag("blocks", parse=parse_integer, help="full KV blocks captured per dtype"),
        shared("reps"),
        Flag("random", switch=True, parse=parse_bool,
             help="also random blocks of the same shape (--no-random: not)"),
        shared("json", help="write the JSON lines here (default: "
               "bench/results/kv-compression-TIME.json)"),
    )),
}


def _add_flags(p: argparse.ArgumentParser, tool: Tool) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(tool.config)}
    for flag in tool.flags:
        flag.add_to(p, default=defaults[flag.dest])


def add_tool_commands(sub: Any) -> None:
    """One ``pdserve bench <name>`` subparser per micro-benchmark, on ``sub`` (an
    ``add_subparsers`` result); each sets ``tool`` so ``run_tool`` finds it, and
    ``func`` (``run_tool``) as the other ``pdserve bench`` subcommands do."""
    for name, tool in TOOLS.items():
        p = sub.add_parser(name, help=tool.help, description=tool.help,
                           formatter_class=HelpFormatter)
        _add_flags(p, tool)
        p.set_defaults(tool=name, func=run_tool)


def build_config(name: str, args: argparse.Namespace) -> Any:
    """The tool's frozen config from its parsed flags; raises ``ValueError`` for a value
    the config refuses."""
    tool = TOOLS[name]
    return tool.config(**{flag.dest: getattr(args, flag.dest) for flag in tool.flags})


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
