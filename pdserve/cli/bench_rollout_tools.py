"""``pdserve bench rollout`` and ``rollout-lora``'s flags (the RL rollout loops), a part of
``bench_micro.TOOLS`` kept here: each tool's flags become its frozen config, whose field
defaults are the flags' defaults."""

from __future__ import annotations

import argparse

from pdserve.bench.micro import configs
from pdserve.bench.micro.rollout.lora_config import RolloutLoraConfig
from pdserve.cli.bench_tool import Tool, csv_list

ROLLOUT_TOOLS: dict[str, Tool] = {
    "rollout": Tool("rollout.loop", configs.RolloutConfig,
                    "an RL rollout loop: a batch of n-sample chat completions, a weight "
                    "update from disk, repeat; tokens/s, refit time, the dip under load", (
        ("--url", {"help": "an existing cluster's router, http://HOST:PORT (default: "
                   "start pdserve up on the default model, with an admin port)"}),
        ("--admin-url", {"help": "with --url: its admin listener, http://HOST:PORT"}),
        ("--api-key", {"help": "the router's API key"}),
        ("--admin-key", {"help": "the admin listener's key"}),
        ("--model-path", {"help": "the checkpoint folder the cluster serves (the rounds "
                          "alternate between it and a perturbed copy)"}),
        ("--checkpoint-dir", {"help": "where the perturbed copy goes, kept (reused when "
                              "it holds one of this scale and seed; default: a "
                              "folder in the cache, removed at the end)"}),
        ("--rounds", {"type": int, "help": "generate-then-refit rounds"}),
        ("--batch", {"type": int, "help": "prompts per round (the chat mix)"}),
        ("--n", {"type": int, "help": "samples per prompt (OpenAI n)"}),
        "--max-tokens",
        ("--temperature", {"type": float, "help": "sampling temperature"}),
        ("--load", {"type": int, "help": "background streams around each refit (0: none, "
                    "no timeline)"}),
        ("--load-max-tokens", {"type": int, "help": "output tokens per background request"}),
        ("--window-s", {"type": float, "help": "the timeline's window"}),
        ("--before-s", {"type": float, "help": "load before the refit call, and after "
                        "its first new token"}),
        ("--policy", {"choices": configs.ROLLOUT_POLICIES,
                      "help": "in-flight requests at the switch"}),
        ("--drain-timeout-s", {"type": float, "help": "drain: at most this long (default: "
                               "the router's)"}),
        ("--scale", {"type": float, "help": "the perturbed copy's noise, times each "
                     "tensor's std"}),
        ("--deadline-s", {"help": "a request or update unanswered after this long fails "
                          "the run"}),
        ("--startup-timeout-s", {"type": float, "help": "pdserve up's start"}),
        "--dtype", "--seed",
        ("--json", {"help": "write results here (default: bench/results/rollout-*.json)"}),
    )),
    "rollout-lora": Tool("rollout.lora_loop", RolloutLoraConfig,
                         "the rollout loop with LoRA: batches under an adapter, adapter "
                         "refits (/pause?mode, /v1/load_lora_adapter, /resume) per pause "
                         "mode, on pdserve up and one aggregated vllm serve in turn; refits "
                         "per minute, refit latency, tokens lost and regenerated", (
        ("--systems", {"type": csv_list(str), "help": "comma-separated: pdserve, vllm (run "
                       "one after the other)"}),
        ("--modes", {"type": csv_list(str), "help": "comma-separated /pause modes: keep, "
                     "abort, wait"}),
        ("--refits", {"type": int, "help": "adapter refits per system and mode"}),
        ("--batch", {"type": int, "help": "prompts per round"}),
        ("--n", {"type": int, "help": "samples per prompt (OpenAI n)"}),
        "--max-tokens",
        ("--temperature", {"type": float, "help": "sampling temperature"}),
        ("--load", {"type": int, "help": "background streams through every refit"}),
        ("--load-max-tokens", {"type": int, "help": "output tokens per background request"}),
        ("--adapters", {"type": int, "help": "random adapter folders the refits cycle "
                        "through"}),
        ("--rank", {"type": int, "help": "the adapters' rank (also --max-lora-rank)"}),
        ("--adapter-name", {"help": "the adapter's served name (the requests' model)"}),
        ("--clear-cache", {"action": argparse.BooleanOptionalAction,
                           "help": "/pause's clear_cache"}),
        ("--pause-timeout-s", {"type": float, "help": "/pause's timeout (wait)"}),
        ("--model-path", {"help": "the base model folder (default: the default model)"}),
        "--dtype",
        ("--kv-cache-gib", {"type": int, "help": "each system's KV cache"}),
        ("--max-model-len", {"type": int, "help": "each system's context"}),
        ("--deadline-s", {"type": float, "help": "a request or admin call unanswered "
                          "this long fails the run"}),
        ("--startup-timeout-s", {"type": float, "help": "each system's start"}),
        "--seed",
        ("--json", {"help": "write results here (default: "
                    "bench/results/rollout-lora-*.json)"}),
    )),
}
