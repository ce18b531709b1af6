"""``pdserve bench rollout-lora``: the RL rollout loop with a LoRA policy, on ``pdserve up``
and on one aggregated ``vllm serve --enable-lora``, in one run, one system after the
other (never both at once), each under every ``/pause`` mode (``lora_rounds.py``).

    HF_HUB_OFFLINE=1 pdserve bench rollout-lora --refits 3 --max-tokens 16

It makes ``--adapters`` random rank-``--rank`` adapters for the model
(``pdserve.bench.models.lora_adapters``, in a folder removed at the end), starts each system
with the first served as ``--adapter-name`` (``lora_systems.py``: same model, dtype, KV
size, context and cores), runs the modes, stops it (proven gone: ``launch.py``), and
prints a table per mode with pdserve / vLLM. A system that fails (its start, a request,
an admin call) has its error in the table and the result, the run goes on to the next,
and the exit code is 1; the result JSON is written either way.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

from pdserve.bench.compare.config import engine_settings
from pdserve.bench.compare.launch import RunningSystem, StartupError
from pdserve.bench.compare.systems import EngineSettings
from pdserve.bench.load.config import DEFAULT_MIX
from pdserve.bench.load.session import write_json
from pdserve.bench.micro import RESULTS_DIR
from pdserve.bench.micro.rollout.lora_client import LoraClient
from pdserve.bench.micro.rollout.lora_config import RolloutLoraConfig
from pdserve.bench.micro.rollout.lora_report import ModeResult, print_modes
from pdserve.bench.micro.rollout.lora_rounds import ModeRounds
from pdserve.bench.micro.rollout.lora_systems import (
    LoraSettings,
    LoraSystem,
    pdserve_lora,
    vllm_lora,
)
from pdserve.bench.models.lora_adapters import make_adapter
from pdserve.bench.workload.generators import MixWorkload, parse_mix
from pdserve.bench.workload.prompts import Messages, PromptEncoder
from pdserve.core.hardware import Hardware
from pdserve.core.model import cache_dir, new_log_dir
from pdserve.core.ports import free_port

console = Console(width=200)
MAX_PROMPT_TOKENS = 512  # the chat mix's long prompts would make each round minutes long


def build_prompts(cfg: RolloutLoraConfig, model_path: str) -> list[Messages]:
    """The chat mix's first prompts of at most ``MAX_PROMPT_TOKENS`` tokens that fit the
    context with their output: every batch's, then the load's."""
    from transformers import AutoTokenizer  # slow to import: only when a bench runs

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    workload = MixWorkload(PromptEncoder(tokenizer, "chat"), parse_mix(DEFAULT_MIX), 0.0,
                           cfg.seed)
    limit = min(MAX_PROMPT_TOKENS, cfg.max_model_len - max(cfg.max_tokens,
                                                           cfg.load_max_tokens) - 8)
    wanted, prompts = max(32, cfg.refits * cfg.batch), []
    for i in range(wanted * 20):
        messages = workload.request(i).messages
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= limit:
            prompts.append(messages)
            if len(prompts) == wanted:
                return prompts
    raise ValueError(f"the chat mix has fewer than {wanted} prompts of at most {limit} "
                     "tokens: raise --max-model-len")


def build_system(which: str, settings: EngineSettings, lora: LoraSettings) -> LoraSystem:
    if which == "vllm":
        return vllm_lora(settings, lora, free_port())
    return pdserve_lora(settings, lora, free_port(), free_port())


async def _modes(cfg: RolloutLoraConfig, system: LoraSystem, prompts: list[Messages],
                 adapters: list[Path]) -> list[ModeResult]:
    """Every mode in turn against the running ``system``; the refits go on cycling
    through ``adapters`` from one mode to the next."""
    results, served = [], 0
    async with LoraClient(system.url, system.admin_url, cfg.adapter_name,
                          cfg.deadline_s) as client:
        for mode in cfg.modes:
            result = ModeResult(system.name, mode)
            rounds = ModeRounds(cfg, client, prompts, adapters, result, served + 1)
            await rounds.run()
            served = rounds.next - 1
            results.append(result)
            s = result.summary()
            console.print(f"{system.name} mode={mode}: {s['refits']} refits, "
                          f"{s['refits_per_min'] or 0:.2f}/min, lost/refit "
                          f"{s['tokens_lost_per_refit']:.1f}, error: {result.error or '-'}")
    return results


def run_system(cfg: RolloutLoraConfig, system: LoraSystem, prompts: list[Messages],
               adapters: list[Path], log_dir: Path) -> tuple[list[ModeResult], dict[str, Any]]:
    """Start ``system``, run the modes, stop it; the results and how it went."""
    info: dict[str, Any] = {"spec": system.spec.to_json()}
    console.print(f"starting {system.name} (logs {log_dir})")
    with RunningSystem(system.spec, log_dir) as running:
        try:
            info["startup_s"] = running.wait_ready(cfg.startup_timeout_s)
        except StartupError as exc:
            error = f"did not start: {exc}"
            results = [ModeResult(system.name, m, error=error) for m in cfg.modes]
        else:
            results = asyncio.run(_modes(cfg, system, prompts, adapters))
        info["stop"] = running.stop().to_json()
    return results, info


def run_config(cfg: RolloutLoraConfig) -> dict[str, Any]:
    settings, choice = engine_settings(cfg.model_path, cfg.dtype, cfg.kv_cache_gib,
                                       cfg.max_model_len)
    log_root = new_log_dir("bench-rollout-lora-")
    folder = Path(tempfile.mkdtemp(prefix="rollout-lora-", dir=cache_dir()))
    results: list[ModeResult] = []
    systems: dict[str, Any] = {}
    try:
        adapters = [make_adapter(settings.model_path, folder / f"adapter-{i}", cfg.seed + i,
                                 rank=cfg.rank) for i in range(cfg.adapters)]
        lora = LoraSettings(cfg.adapter_name, adapters[0], 1, cfg.rank)
        prompts = build_prompts(cfg, settings.model_path)
        for which in cfg.systems:
            system = build_system(which, settings, lora)
            got, systems[which] = run_system(cfg, system, prompts, adapters,
                                             log_root / which)
            results += got
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print_modes(results, console)
    return {"config": asdict(cfg), "machine": Hardware.detect().describe(),
            "dtype": choice.dtype, "model": settings.model_path, "logs": str(log_root),
            "systems": systems, "modes": [r.to_json() for r in results]}


def run(cfg: RolloutLoraConfig) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run_config(cfg)
    out = Path(cfg.json) if cfg.json else (
        RESULTS_DIR / f"rollout-lora-{time.strftime('%Y%m%d-%H%M%S')}.json")
    write_json(str(out), result)
    console.print(f"wrote {out}")
    failed = [f"{m['system']}/{m['mode']}" for m in result["modes"] if m["summary"]["error"]]
    if failed:
        console.print(f"[red]pdserve bench rollout-lora: FAILED: {', '.join(failed)}[/]")
    return 1 if failed else 0
