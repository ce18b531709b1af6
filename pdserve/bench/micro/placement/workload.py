"""The shared-prefix chat workload of ``pdserve bench placement``: S system prompts x U
users per system prompt, T turns each (a turn's prompt is the whole conversation so
far), conversations interleaved over system prompts and run C at a time."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

WORDS = ("river mill north stone bridge lantern harbor meadow copper willow thunder garden "
         "candle orchard falcon ember glacier pepper saddle violet marble timber cobalt "
         "prairie").split()


@dataclass(frozen=True)
class Workload:
    num_systems: int
    users_per_system: int
    turns: int
    system_words: int  # ~1.3 tokens per word with this vocabulary and the chat template
    concurrency: int
    max_tokens: int = 4
    seed: int = 0

    def systems(self) -> list[str]:
        rng = random.Random(self.seed)
        return [f"You are assistant #{s}. Policy: "
                + " ".join(rng.choice(WORDS) for _ in range(self.system_words))
                for s in range(self.num_systems)]


@dataclass
class Stats:
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # as the responses report them (usage.prompt_tokens_details)
    errors: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict[str, float]:
        q = statistics.quantiles(self.ttft_s, n=100) if len(self.ttft_s) > 1 else self.ttft_s * 99
        return {"requests": len(self.ttft_s), "errors": self.errors,
                "ttft_p50_s": statistics.median(self.ttft_s), "ttft_p99_s": q[98],
                "prompt_tokens": self.prompt_tokens,
                "reported_hit_rate": self.cached_tokens / max(self.prompt_tokens, 1),
                "wall_s": self.wall_s, "requests_per_s": len(self.ttft_s) / self.wall_s,
                "prompt_tokens_per_s": self.prompt_tokens / self.wall_s}


async def _turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]],
                max_tokens: int, stats: Stats) -> str:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first: float | None = None
    text = ""
    async with client.stream("POST", url + "/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            stats.errors += 1
            return ""
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # failed mid-stream: counted, not timed
                stats.errors += 1
                return ""
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
            for choice in chunk.get("choices") or []:
                text += choice["delta"].get("content") or ""
            if chunk.get("usage"):
                stats.prompt_tokens += chunk["usage"]["prompt_tokens"]
                stats.cached_tokens += chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    stats.ttft_s.append((first or time.perf_counter()) - start)
    return text


async def _conversation(client: httpx.AsyncClient, url: str, model: str, w: Workload,
                        system: str, user: int, stats: Stats) -> None:
    rng = random.Random(f"{w.seed}-{system[:60]}-{user}")
    messages = [{"role": "system", "content": system}]
    for t in range(w.turns):
        question = f"User {user}, turn {t}: tell me about the " + " ".join(
            rng.choice(WORDS) for _ in range(12)) + "."
        messages.append({"role": "user", "content": question})
        answer = await _turn(client, url, model, messages, w.max_tokens, stats)
        messages.append({"role": "assistant", "content": answer or "ok"})


async def run_workload(url: str, model: str, w: Workload) -> Stats:
    systems = w.systems()
    stats = Stats()
    # Interleaved: consecutive conversations use different system prompts.
    convs = [(systems[s], u) for u in range(w.users_per_system) for s in range(w.num_systems)]
    gate = asyncio.Semaphore(w.concurrency)

    async def one(system: str, user: int) -> None:
        async with gate:
            await _conversation(client, url, model, w, system, user, stats)

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(s, u) for s, u in convs))
    stats.wall_s = time.perf_counter() - start
    return stats
