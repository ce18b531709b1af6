"""One system's rollout loop with LoRA under one ``/pause`` mode.

``refits`` rounds of a batch (``batch`` prompts x ``n`` samples under the adapter, all
awaited) while ``load`` background streams run, each round ending in an adapter refit,
vLLM's RL sequence:

    POST /pause?mode=M&clear_cache=..&timeout=..   (what runs: ended, waited for, frozen)
    POST /v1/load_lora_adapter {lora_name, lora_path: <next folder>, load_inplace: true}
    POST /resume

then a probe (4 tokens, greedy) under the adapter, whose first token ends the refit's
time. A response cut (``finish_reason: "abort"``, or no finish) is sent again, as an RL
client must (``refits`` times at most: a refit cuts it once at most); a failed request
or admin call ends the loop (``ModeResult.error``). Refits per minute: refits done over
the loop's wall time (first batch sent to the last probe's first token).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

from pdserve.bench.micro.rollout.lora_client import LoraClient
from pdserve.bench.micro.rollout.lora_config import RolloutLoraConfig
from pdserve.bench.micro.rollout.lora_report import (
    LoraCheckError,
    ModeResult,
    RefitTiming,
    check_sample,
)
from pdserve.bench.workload.prompts import Messages

PROBE: Messages = [{"role": "user", "content": "Say hello."}]


class ModeRounds:
    """The loop under ``mode``, refitting through ``adapters`` from ``adapters[start]``
    on (the folder after the one served now)."""

    def __init__(self, cfg: RolloutLoraConfig, client: LoraClient, prompts: Sequence[Messages],
                 adapters: Sequence[Path], result: ModeResult, start: int) -> None:
        self.cfg, self.client, self.prompts, self.adapters = cfg, client, prompts, adapters
        self.result, self.next = result, start
        self._stopping = asyncio.Event()
        self._load_error = ""

    async def generate(self, kind: str, prompt: Messages, n: int, max_tokens: int,
                       seed: int) -> None:
        """One request, sent again while it comes back cut; every answer recorded."""
        sends = self.cfg.refits + 1  # each refit cuts a request once at most
        for attempt in range(sends):
            sample = await self.client.stream(kind if not attempt else "regen", prompt, n,
                                              max_tokens, self.cfg.temperature, seed)
            self.result.samples.append(sample)
            check_sample(sample)
            if not sample.cut():
                return
        raise LoraCheckError(f"a {kind} request came back cut {sends} times: more than "
                             "one cut per refit")

    async def _load(self, index: int) -> None:
        sent = 0
        try:
            while not self._stopping.is_set():
                prompt = self.prompts[(index + sent * self.cfg.load) % len(self.prompts)]
                await self.generate("load", prompt, 1, self.cfg.load_max_tokens,
                                    self.cfg.seed + 1000 * index + sent)
                sent += 1
        except LoraCheckError as exc:
            self._load_error = str(exc)

    async def run(self) -> ModeResult:
        loads = [asyncio.create_task(self._load(i)) for i in range(self.cfg.load)]
        started = time.monotonic()
        try:
            for index in range(self.cfg.refits):
                await self.batch(index)
                self.result.refits.append(await self.refit())
                if self._load_error:
                    raise LoraCheckError(self._load_error)
            self.result.wall_s = self.result.refits[-1].probe_first_s - started
        except LoraCheckError as exc:
            self.result.error = str(exc)
        finally:
            await self._stop(loads)
        if self._load_error and not self.result.error:
            self.result.error = self._load_error
        return self.result

    async def _stop(self, loads: list[asyncio.Task[None]]) -> None:
        """No new load requests; those in flight end under the client's deadline."""
        self._stopping.set()
        if loads:
            await asyncio.wait(loads, timeout=self.client.deadline_s + 5)
        for task in loads:
            task.cancel()

    async def batch(self, index: int) -> None:
        """The round's requests at once; the first to fail cancels the rest."""
        cfg = self.cfg
        try:
            async with asyncio.TaskGroup() as group:
                for i in range(cfg.batch):
                    at = index * cfg.batch + i
                    group.create_task(self.generate(
                        "batch", self.prompts[at % len(self.prompts)], cfg.n,
                        cfg.max_tokens, cfg.seed + at))
        except ExceptionGroup as failed:
            first = failed.exceptions[0]
            raise first if isinstance(first, LoraCheckError) else failed from None

    async def refit(self) -> RefitTiming:
        """Pause, load the next folder under the adapter's name, resume (also when the
        load failed: the next mode needs the system serving), probe."""
        cfg, path = self.cfg, self.adapters[self.next % len(self.adapters)]
        call = time.monotonic()
        await self.client.pause(self.result.mode, cfg.clear_cache, cfg.pause_timeout_s)
        paused = time.monotonic()
        try:
            await self.client.load(cfg.adapter_name, str(path))
        finally:
            loaded = time.monotonic()
            await self.client.resume()
        resumed = time.monotonic()
        self.next += 1
        probe = await self.client.stream("probe", PROBE, 1, 4, 0.0, 0)
        self.result.samples.append(probe)
        check_sample(probe)
        if not probe.num_tokens:
            raise LoraCheckError("the probe after a refit carried no token")
        return RefitTiming(call, paused, loaded, resumed, probe.first_token_s)
