"""``pdserve bench rollout`` and ``rollout-lora``'s flags (the RL rollout loops), a part of
``bench_micro.TOOLS`` kept here: each tool's flags become its frozen config, whose field
defaults are the flags' defaults."""

from __future__ import annotations

from pdserve.bench.micro import configs
from pdserve.bench.micro.rollout.lora_config import RolloutLoraConfig
from pdserve.cli.bench_tool import Tool, csv_list, shared
from pdserve.cli.flag_types import Flag, parse_bool, parse_integer, parse_number

ROLLOUT_TOOLS: dict[str, Tool] = {
    "rollout": Tool("rollout.loop", configs.RolloutConfig,
                    "an RL rollout loop: a batch of n-sample chat completions, a weight "
                    "update from disk, repeat; tokens/s, refit time, the dip under load", (
        Flag("url", help="an existing cluster's router, http://HOST:PORT (default: "
             "start pdserve up on the default model, with an admin port)"),
        Flag("admin-url", help="with --url: its admin listener, http://HOST:PORT"),
        Flag("api-key", help="the router's API key"),
        Flag("admin-key", help="the admin listener's key"),
        Flag("model-path", help="the checkpoint folder the cluster serves (the rounds "
             "alternate between it and a perturbed copy)"),
        Flag("checkpoint-dir", help="where the perturbed copy goes, kept (reused when "
             "it holds one of this scale and seed; default: a "
             "folder in the cache, removed at the end)"),
        Flag("rounds", parse=parse_integer, help="generate-then-refit rounds"),
        Flag("batch", parse=parse_integer, help="prompts per round (the chat mix)"),
        Flag("n", parse=parse_integer, help="samples per prompt (OpenAI n)"),
        shared("max-tokens"),
        Flag("temperature", parse=parse_number, help="sampling temperature"),
        Flag("load", parse=parse_integer, help="background streams around each refit (0: none, "
             "no timeline)"),
        Flag("load-max-tokens", parse=parse_integer, help="output tokens per background request"),
        Flag("window-s", parse=parse_number, help="the timeline's window"),
        Flag("before-s", parse=parse_number, help="load before the refit call, and after "
             "its first new token"),
        Flag("policy", choices=configs.ROLLOUT_POLICIES,
             help="in-flight requests at the switch"),
        Flag("drain-timeout-s", parse=parse_number, help="drain: at most this long (default: "
             "the router's)"),
        Flag("scale", parse=parse_number, help="the perturbed copy's noise, times each "
             "tensor's std"),
        shared("deadline-s", help="a request or update unanswered after this long fails "
               "the run"),
        Flag("startup-timeout-s", parse=parse_number, help="pdserve up's start"),
        shared("dtype"), shared("seed"),
        shared("json", help="write results here (default: bench/results/rollout-*.json)"),
    )),
    "rollout-lora": Tool("rollout.lora_loop", RolloutLoraConfig,
                         "the rollout loop with LoRA: batches under an adapter, adapter "
                         "refits (/pause?mode, /v1/load_lora_adapter, /resume) per pause "
                         "mode, on pdserve up and one aggregated vllm serve in turn; refits "
                         "per minute, refit latency, tokens lost and regenerated", (
        Flag("systems", parse=csv_list(str), help="comma-separated: pdserve, vllm (run "
             "one after the other)"),
        Flag("modes", parse=csv_list(str), help="comma-separated /pause modes: keep, "
             "abort, wait"),
        Flag("refits", parse=parse_integer, help="adapter refits per system and mode"),
        Flag("batch", parse=parse_integer, help="prompts per round"),
        Flag("n", parse=parse_integer, help="samples per prompt (OpenAI n)"),
        shared("max-tokens"),
        Flag("temperature", parse=parse_number, help="sampling temperature"),
        Flag("load", parse=parse_integer, help="background streams through every refit"),
        Flag("load-max-tokens", parse=parse_integer, help="output tokens per background request"),
        Flag("adapters", parse=parse_integer, help="random adapter folders the refits cycle "
             "through"),
        Flag("rank", parse=parse_integer, help="the adapters' rank (also --max-lora-rank)"),
        Flag("adapter-name", help="the adapter's served name (the requests' model)"),
        Flag("clear-cache", switch=True, parse=parse_bool,
             help="/pause's clear_cache"),
        Flag("pause-timeout-s", parse=parse_number, help="/pause's timeout (wait)"),
        Flag("model-path", help="the base model folder (default: the default model)"),
        shared("dtype"),
        Flag("kv-cache-gib", parse=parse_integer, help="each system's KV cache"),
        Flag("max-model-len", parse=parse_integer, help="each system's context"),
        shared("deadline-s", parse=parse_number, help="a request or admin call unanswered "
               "this long fails the run"),
        Flag("startup-timeout-s", parse=parse_number, help="each system's start"),
        shared("seed"),
        shared("json", help="write results here (default: "
               "bench/results/rollout-lora-*.json)"),
    )),
}
