"""The flags of ``pdserve bench run``, ``sweep``, ``compare``, ``gaps`` and
``disagg-proxy``, declared as every flag is (``flag_types.py``: each reads its
``PDSERVE_<FLAG>`` variable); ``bench_flags.py`` picks each subcommand's and builds its
config. The micro-benchmarks' flags are in ``bench_tool.py`` and their tables."""

from __future__ import annotations

from pathlib import Path

from pdserve.bench.compare.config import DEFAULT_RATES
from pdserve.bench.load.config import DEFAULT_MIX
from pdserve.bench.workload.generators import WORKLOADS
from pdserve.cli.flag_types import Flag, parse_bool, parse_integer, parse_number
from pdserve.core.dtype import DTYPES

# --- run (and sweep): by argument group ------------------------------------------------

ENDPOINT = (
    Flag("base-url", "the server, e.g. http://127.0.0.1:8000 (with or without /v1)",
         required=True),
    Flag("model", "the served model name (default: the server's first)"),
    Flag("endpoint", "", "chat", choices=("chat", "completions")),
    # Its default, when PDSERVE_API_KEY is not set: $OPENAI_API_KEY (bench_flags.py).
    Flag("api-key", "bearer key (default: $PDSERVE_API_KEY, else $OPENAI_API_KEY)"),
    Flag("tokenizer", "tokenizer folder (default: --model if it is a local folder, else "
         "pdserve's default model folder)"),
    Flag("max-model-len", "context length when the server's /v1/models does not say",
         parse=parse_integer),
    Flag("request-timeout-s", "deadline of each request", 600.0, parse_number),
    Flag("ignore-eos", "ask for exact output lengths (default: on for synthetic workloads)",
         parse=parse_bool, switch=True),
)
WORKLOAD = (
    Flag("workload", "", "random", choices=WORKLOADS),
    Flag("input-len", "random: prompt tokens", 256, parse_integer),
    Flag("output-len", "output tokens (random, shared-prefix, no-reuse: default 128; "
         "sharegpt: overrides the reference completion's length; mooncake-trace: caps the "
         "trace's scaled output length)", parse=parse_integer),
    Flag("range-ratio", "random, chat-mix: lengths uniform within +-ratio", 0.0, parse_number),
    Flag("mix", "chat-mix: SHARE:INPUT:OUTPUT,... (default %(default)s)", DEFAULT_MIX),
    Flag("mix-then", "chat-mix: a second mix the load shifts to at --mix-shift-at (a load "
         "that changes under the system)"),
    Flag("mix-shift-at", "chat-mix with --mix-then: the index of the first request drawn "
         "from it (default: half of --num-requests)", parse=parse_integer),
    Flag("num-system-prompts", "shared-prefix, no-reuse: system prompts the users share", 2,
         parse_integer),
    Flag("system-prompt-len", "shared-prefix, no-reuse: tokens of each system prompt", 512,
         parse_integer),
    Flag("num-users", "shared-prefix, no-reuse: conversations, their turns interleaved", 4,
         parse_integer),
    Flag("num-turns", "shared-prefix, no-reuse: turns of each conversation", 3,
         parse_integer),
    Flag("turn-input-len", "shared-prefix, no-reuse: tokens of each user turn", 64,
         parse_integer),
    Flag("dataset", "sharegpt: a .json or .jsonl file; mooncake-trace: a Mooncake trace "
         "(JSONL: timestamp, input_length, output_length, hash_ids), replayed from "
         "--trace-start, --num-requests of it"),
    Flag("trace-block-tokens", "mooncake-trace: tokens per hash_id block (the trace's are "
         "512; prompt and output lengths scale by the same factor)", 512, parse_integer),
    Flag("trace-time-scale", "mooncake-trace: the trace's arrival times multiplied by this "
         "(0.1: ten times the trace's rate; 0: all at once); or give --request-rate R: the "
         "times scaled to a mean of R requests/s", 1.0, parse_number),
    Flag("trace-start", "mooncake-trace: the index of the first record replayed", 0,
         parse_integer),
)
TRAFFIC = (
    Flag("num-requests", "requests to draw (default 100 unless --duration-s)",
         parse=parse_integer, aliases=("num-prompts",)),  # vllm bench serve's spelling
    Flag("duration-s", "send for this long instead", parse=parse_number),
    Flag("num-warmup", "unmeasured requests first", 1, parse_integer),
    Flag("request-rate", "requests/s (inf: all at once; mooncake-trace: the trace's times "
         "scaled to this mean rate, inf: its own times)", float("inf"), parse_number),
    Flag("burstiness", "1: Poisson; <1 burstier, >1 more regular (gamma intervals)", 1.0,
         parse_number),
    Flag("max-concurrency", "most requests in flight", parse=parse_integer),
    Flag("seed", "", 0, parse_integer),
)
OUTPUT = (
    Flag("slo", 'e.g. "ttft=2s,tpot=100ms,e2e=30s" (any subset)'),
    Flag("result-json", "write the result here (only after a full run)"),
    Flag("no-progress", "", store_true=True),
)
RUN_GROUPS = (("endpoint", ENDPOINT), ("workload", WORKLOAD), ("traffic", TRAFFIC),
              ("output", OUTPUT))
RUN_FLAGS = {flag.name: flag for _, flags in RUN_GROUPS for flag in flags}

# sweep's points: one of the two (given, or set in the environment).
SWEEP_POINTS = (
    Flag("request-rates", 'comma-separated, e.g. "0.5,1,1.5"'),
    Flag("max-concurrencies", 'comma-separated, e.g. "1,2,4"'),
)
GOODPUT_SHARE = Flag("goodput-share", "a point meets the SLO when this share of its "
                     "requests does", 0.9, parse_number)

# --- systems' engines (compare, gaps) ----------------------------------------------------

ENGINE = (
    Flag("model", "local HF model folder (default: pdserve's bundled "
         "SmolLM2-135M-Instruct)"),
    Flag("dtype", "every engine's dtype; auto is resolved once as pdserve does (bfloat16 "
         "on CPUs with native bf16, float32 on the others)", "auto", choices=DTYPES),
    Flag("kv-cache-gib", "KV cache per engine (GiB)", 2, parse_integer),
    Flag("num-kv-blocks", "KV blocks of aggregated vLLM and of each prefill engine "
         "(overrides --kv-cache-gib there): a cache small enough that a workload's working "
         "set exceeds it. pdserve's decode workers keep --kv-cache-gib: give its entries "
         "--disagg always so every prompt is computed on a capped engine",
         parse=parse_integer),
    Flag("max-model-len", "", 4096, parse_integer),
)

# compare's and gaps' own; each takes these by name, with its own defaults (``SYSTEMS``).
_SYSTEMS = (
    Flag("request-rates", "comma-separated req/s ('inf': all at once); one run per rate",
         DEFAULT_RATES),
    Flag("pdserve", "a pdserve configuration: a name and `pdserve up` flags, e.g. "
         "split='--cpu-layout split'; repeatable (default: default='')", metavar="NAME='FLAGS'",
         parse=lambda text: (text,), repeat=True),
    Flag("with-vllm-disagg", "also run vLLM's own disaggregated serving (NixlConnector)",
         store_true=True),
    Flag("no-vllm", "skip aggregated vLLM, tuned (the baseline) and stock (no ratios then)",
         store_true=True),
    Flag("no-vllm-stock", "skip stock vllm serve (the tuned baseline still runs)", False,
         parse_bool, store_true=True),
    Flag("vllm-url", "the baseline is the vLLM OpenAI server already running at URL "
         "(http://HOST:PORT, with or without /v1), named vllm-external, in place of the "
         "vllm-tuned compare would start: compare neither starts nor stops it, and its "
         "engine settings are its operator's (compare cannot check they match). It must "
         "answer /v1/models within --startup-timeout-s and serve --model's name. Stock vllm "
         "still starts unless --no-vllm-stock", metavar="URL"),
    Flag("output-dir", "where the report goes (must not exist or be empty; default "
         "bench/results/compare-<time>)", parse=Path),
    Flag("startup-timeout-s", "", 600.0, parse_number),
    Flag("run-timeout-s", "deadline of one bench run (one system at one rate)", 1800.0,
         parse_number),
    Flag("stop-timeout-s", "SIGTERM grace before SIGKILL when stopping a system", 60.0,
         parse_number),
    Flag("seed", "", 0, parse_integer),
    Flag("cost-per-hour", "price each system's runs: $ per hour of a core its engines ran on "
         "(0.05 or 0.05/core) or of the node (2.4/node); the report gains $ per million "
         "input, output and within-SLO tokens", metavar="PRICE[/core|/node]"),
    Flag("num-requests", "lone requests per kind", 6, parse_integer, aliases=("num-prompts",)),
    Flag("stall-s", "a gap this long between two tokens counts as a stall", 1.0,
         parse_number),
)
SYSTEMS = {flag.name: flag for flag in _SYSTEMS}

# --- disagg-proxy (compare's, not a user's) ----------------------------------------------

PROXY = (
    Flag("host", "", "127.0.0.1", env_var="PDSERVE_PROXY_HOST"),  # not a deployment's
    Flag("port", "", parse=parse_integer, required=True),
    Flag("prefill", "the prefill engine's base URL", required=True),
    Flag("decode", "the decode engine's base URL", required=True),
)
