"""The RL rollout loop: generate a batch, refit the weights, repeat; what the serving side
of a post-training loop sees.

Each round generates ``--batch`` prompts of the chat mix (``pdserve bench run``'s
``chat-mix``), each with ``--n`` samples, on the current weights (tokens/s), then refits:
``POST /update_weights_from_disk`` on the router's admin listener, alternating between a
perturbed copy of the served checkpoint (``pdserve.bench.models.checkpoints``) and the original,
versions ``r1``, ``r2``, ... The refit's time end to end runs from the call to the first
token of a streamed probe sent once the call returns, which must come from the new
version. With ``--load N``, N streams of chat requests run from ``--before-s`` before the
call until ``--before-s`` after that first token: their tokens/s in ``--window-s``
windows before, during and after the refit, and the dip.

Every response is checked: HTTP 200, ``system_fingerprint`` and ``x-weight-version`` the
version expected when it ran (a load stream that began after the call returned must be
on the new version, one that ended before it on the old, none mixed); any failure ends
the run with exit code 1 and no result file.

    HF_HUB_OFFLINE=1 pdserve bench rollout --rounds 2 --batch 4 --n 2 --max-tokens 32
    pdserve bench rollout --url http://h:8000 --admin-url http://h:8001 --admin-key K

Without ``--url`` it starts ``pdserve up`` on the default model with an admin port and
stops it at the end (removing the perturbed checkpoint it made).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from pdserve.bench.load.config import DEFAULT_MIX
from pdserve.bench.load.session import write_json
from pdserve.bench.micro import RESULTS_DIR
from pdserve.bench.micro.configs import RolloutConfig
from pdserve.bench.micro.faults import Cluster
from pdserve.bench.micro.rollout.client import BackgroundLoad, RolloutClient, check_all_on
from pdserve.bench.micro.rollout.report import (
    RefitSpan,
    RolloutCheckError,
    RoundResult,
    Timeline,
    check_load,
    check_stream,
    print_rounds,
    summarize,
)
from pdserve.bench.models.checkpoints import perturb_checkpoint
from pdserve.bench.workload.bench_tokenizer import load_bench_tokenizer
from pdserve.bench.workload.generators import MixWorkload, parse_mix
from pdserve.bench.workload.prompts import Messages, PromptEncoder
from pdserve.core.dtype import resolve_dtype
from pdserve.core.model import cache_dir, new_log_dir, prepare_default_model
from pdserve.core.ports import free_port

PROBE = [{"role": "user", "content": "Say hello."}]
console = Console(width=160)


@dataclass(frozen=True)
class Checkpoints:
    """The two checkpoints the rounds alternate between."""

    original: Path
    perturbed: Path

    def for_round(self, index: int) -> Path:
        return self.perturbed if index % 2 else self.original


@dataclass
class Refit:
    span: RefitSpan
    answer: dict[str, Any]
    load_versions: dict[str, int]
    timeline: Timeline | None


class Rounds:
    """The loop itself, against one cluster."""

    def __init__(self, cfg: RolloutConfig, client: RolloutClient, prompts: list[Messages],
                 checkpoints: Checkpoints) -> None:
        self.cfg, self.client, self.prompts, self.checkpoints = cfg, client, prompts, checkpoints

    async def run(self) -> tuple[str, list[RoundResult]]:
        await self.client.resolve_model()
        version = str((await self.client.weight_info()).get("weight_version"))
        await self.client.generate(PROBE, self.cfg.n, 4, self.cfg.temperature, 0, version)
        results = []
        for index in range(1, self.cfg.rounds + 1):
            results.append(await self.round(index, version))
            version = results[-1].version
            console.print(f"round {index}: {results[-1].batch_tok_s:.1f} tok/s on "
                          f"{results[-1].batch_version}; refit to {version} in "
                          f"{results[-1].refit_e2e_s:.2f} s (call to first token)")
        return version, results

    async def round(self, index: int, version: str) -> RoundResult:
        cfg = self.cfg
        batch = self.prompts[(index - 1) * cfg.batch: index * cfg.batch]
        started = time.monotonic()
        tokens = await asyncio.gather(*(
            self.client.generate(p, cfg.n, cfg.max_tokens, cfg.temperature,
                                 cfg.seed + index * 1000 + i, version)
            for i, p in enumerate(batch)))
        batch_s = time.monotonic() - started
        path, new = self.checkpoints.for_round(index), f"r{index}"
        refit = await self.refit(path, version, new)
        return RoundResult(index, version, new, str(path), len(batch), len(batch) * cfg.n,
                           sum(tokens), batch_s, refit.span.returned_s - refit.span.call_s,
                           float(refit.answer.get("seconds", 0.0)),
                           refit.answer.get("stage_seconds"), refit.span.end_to_end_s,
                           refit.load_versions, refit.timeline)

    async def refit(self, path: Path, old: str, new: str) -> Refit:
        """The update under the background load (if any), then the probe; the load's
        streams are cancelled if a check fails on the way."""
        cfg = self.cfg
        if not cfg.load:
            return Refit(*await self._switch(path, new), {}, None)
        load = BackgroundLoad(self.client, self.prompts, cfg.load, cfg.load_max_tokens,
                              cfg.temperature, cfg.seed)
        load_start = time.monotonic()
        load.start()
        try:
            await asyncio.sleep(cfg.before_s)
            span, answer = await self._switch(path, new)
            await asyncio.sleep(max(0.0, span.first_token_s + cfg.before_s - time.monotonic()))
        except BaseException:
            load.cancel()
            raise
        load_end = time.monotonic()
        records = await load.stop()
        warm = load.warm_s(load_start)  # windows end at the call, none before the load is warm
        start = span.call_s - cfg.window_s * math.floor((span.call_s - warm) / cfg.window_s)
        return Refit(span, answer, check_load(records, span, old, new),
                     Timeline.of(records, start, load_end, cfg.window_s, span))

    async def _switch(self, path: Path, new: str) -> tuple[RefitSpan, dict[str, Any]]:
        """The update call, then a probe whose first token must come from ``new``, and
        ``/weight_info`` saying every worker is on it; the span and the call's answer."""
        call = time.monotonic()
        answer = await self.client.update(str(path), new, self.cfg.policy,
                                                self.cfg.drain_timeout_s)
        returned = time.monotonic()
        probe = await self.client.stream(PROBE, 4, 0.0, 0)
        check_stream(probe, (new,))
        if not probe.events:
            raise RolloutCheckError(f"the probe after the update to {new!r} carried no token")
        check_all_on(await self.client.weight_info(), new, "/weight_info after the update")
        return RefitSpan(call, returned, probe.first_token_s), answer


def build_prompts(cfg: RolloutConfig, tokenizer_path: Path) -> list[Messages]:
    """Every round's batch, in order: the chat mix's first ``rounds x batch`` prompts."""
    encoder = PromptEncoder(load_bench_tokenizer(tokenizer_path), "chat")
    workload = MixWorkload(encoder, parse_mix(DEFAULT_MIX), 0.0, cfg.seed)
    return [workload.request(i).messages for i in range(cfg.rounds * cfg.batch)]


def make_checkpoints(cfg: RolloutConfig, original: Path, stamp: str) -> Checkpoints:
    """The original and its perturbed copy: reused if ``--checkpoint-dir`` already holds
    one of this scale and seed, else made (about 10 s for the default model)."""
    root = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else (
        cache_dir() / "checkpoints" / f"rollout-{stamp}")
    perturbed = root / f"{original.name}-scale{cfg.scale:g}-seed{cfg.seed}"
    if not (perturbed / "config.json").is_file():
        console.print(f"perturbing {original} into {perturbed} (scale {cfg.scale:g})")
        perturb_checkpoint(original, perturbed, scale=cfg.scale, seed=cfg.seed)
    return Checkpoints(original.resolve(), perturbed.resolve())


@contextlib.contextmanager
def started_cluster(cfg: RolloutConfig, log_dir: Path) -> Iterator[tuple[str, str]]:
    """``pdserve up`` with an admin listener; (router URL, admin URL); stopped on exit."""
    port, admin = free_port(), free_port()
    argv = ["--port", str(port), "--admin-port", str(admin), "--dtype", cfg.dtype,
            "--startup-timeout-s", str(cfg.startup_timeout_s)]
    if cfg.model_path:
        argv += ["--model", cfg.model_path]
    console.print(f"pdserve up {' '.join(argv)}  (log {log_dir / 'up.log'})")
    cluster = Cluster(argv, port, log_dir, cfg.startup_timeout_s + 30)
    try:
        yield cluster.root, f"http://127.0.0.1:{admin}"
    finally:
        cluster.stop()


async def _against(cfg: RolloutConfig, url: str, admin_url: str, prompts: list[Messages],
                   checkpoints: Checkpoints) -> tuple[str, list[RoundResult]]:
    async with RolloutClient(url, admin_url, cfg.api_key, cfg.admin_key,
                             cfg.deadline_s) as client:
        return await Rounds(cfg, client, prompts, checkpoints).run()


def run_config(cfg: RolloutConfig) -> dict[str, Any]:
    """The rounds against ``cfg.url``'s cluster, or one started here; the result."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    original = Path(cfg.model_path) if cfg.model_path else prepare_default_model()
    checkpoints = make_checkpoints(cfg, original, stamp)
    prompts = build_prompts(cfg, original)
    if cfg.url and cfg.admin_url:
        final, rounds = asyncio.run(_against(cfg, cfg.url, cfg.admin_url, prompts,
                                             checkpoints))
        console.print(f"the cluster is left on {final} ({checkpoints.for_round(cfg.rounds)})")
    else:
        log_dir = new_log_dir("bench-rollout-")
        try:
            with started_cluster(cfg, log_dir) as (url, admin_url):
                final, rounds = asyncio.run(_against(cfg, url, admin_url, prompts,
                                                     checkpoints))
        finally:
            if not cfg.checkpoint_dir:
                shutil.rmtree(checkpoints.perturbed.parent, ignore_errors=True)
    print_rounds(rounds, console)
    summary = summarize(rounds)
    console.print("medians: " + json.dumps({k: v if v is None else round(v, 3)
                                           for k, v in summary.items()}))
    return {"config": asdict(cfg), "cpu_model": resolve_dtype("auto").hardware.cpu_model,
            "checkpoints": {k: str(v) for k, v in asdict(checkpoints).items()},
            "final_version": final, "summary": summary,
            "rounds": [r.to_json() for r in rounds]}


def run(cfg: RolloutConfig) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        result = run_config(cfg)
    except RolloutCheckError as exc:
        console.print(f"[red]pdserve bench rollout: FAILED: {exc}[/]; no result written")
        return 1
    out = Path(cfg.json) if cfg.json else (
        RESULTS_DIR / f"rollout-{time.strftime('%Y%m%d-%H%M%S')}.json")
    write_json(str(out), result)
    console.print(f"wrote {out}")
    return 0
