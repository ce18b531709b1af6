"""Placement decision time: 64 prefill workers, 100k indexed blocks.

A decision = the prompt's prefix match against the index (``PrefixIndex.match``)
+ the policy's ``choose`` over every worker's snapshot; prompt hashing (once per
request, before placement) is timed separately, and so is what the dispatcher adds:
gathering the pool's snapshots once per decision, and publishing a new snapshot
per in-flight hook (``on_sent`` / ``on_finished``). Prints p50/p99 per policy, the
target (p99 <= 200 us for cache_aware) and cache_aware's ratio to round_robin,
measured in the same run.

    pdserve bench placement-decision [--workers 64] [--blocks 100000]
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import time

from prometheus_client import CollectorRegistry

from pdserve.bench.micro.configs import PlacementDecisionConfig
from pdserve.core.block_hash import chain_hashes
from pdserve.membership.static import static_infos
from pdserve.router.dispatch.policies.placement import (
    PLACEMENTS,
    PlacementRequest,
    create_placement,
)
from pdserve.router.dispatch.prefix.index import PrefixIndex
from pdserve.router.dispatch.prefix.routing import PrefixRouting
from pdserve.router.dispatch.workers.pool import Worker
from pdserve.router.dispatch.workers.state import WorkerLoad, WorkerState

BLOCK_SIZE = 128
TARGET_P99_US = 200.0


def build(num_workers: int, num_blocks: int, seed: int) -> tuple[
        PrefixIndex, list[list[int]], list[WorkerState], list[WorkerState]]:
    """Prefixes of 32 blocks (4k tokens) spread over workers until the index holds
    ``num_blocks`` (worker, block) entries; each prefix is on 1-4 workers."""
    rng = random.Random(seed)
    index = PrefixIndex()
    prompts: list[list[int]] = []
    entries = 0
    held: dict[str, list[int]] = {f"p{i}": [] for i in range(num_workers)}
    while entries < num_blocks:
        tokens = [rng.randrange(50_000) for _ in range(32 * BLOCK_SIZE)]
        prompts.append(tokens)
        hashes = chain_hashes(tokens, BLOCK_SIZE)
        for w in rng.sample(sorted(held), rng.randint(1, 4)):
            n = rng.randint(8, 32)  # some workers hold only the front of the prefix
            held[w] += hashes[:n]
            entries += n
    for w, hashes in held.items():
        index.replace(w, BLOCK_SIZE, hashes)
    prefill = [WorkerState(endpoint=f"p{i}", role="prefill", healthy=True, worker_id=f"p{i}",
                           compatibility_hash="a", num_assigned=rng.randint(0, 3),
                           num_assigned_tokens=rng.randint(0, 4000),
                           load=WorkerLoad(num_running_reqs=rng.randint(0, 2)))
               for i in range(num_workers)]
    decode = [WorkerState(endpoint=f"d{i}", role="decode", healthy=True, worker_id=f"d{i}",
                          compatibility_hash="a",
                          load=WorkerLoad(kv_cache_usage=rng.random()))
              for i in range(max(1, num_workers // 4))]
    return index, prompts, prefill, decode


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def make_requests(prompts: list[list[int]], seed: int) -> list[list[int]]:
    """A known prefix (cut at a random point) + a new suffix, or all new."""
    rng = random.Random(seed)
    requests = []
    for _ in range(512):
        base = rng.choice(prompts)[: rng.randint(1, 32) * BLOCK_SIZE]
        if rng.random() < 0.2:
            base = [rng.randrange(50_000) for _ in range(len(base))]
        requests.append(base + [rng.randrange(50_000) for _ in range(rng.randint(10, 300))])
    return requests


def time_policies(index: PrefixIndex, requests: list[list[int]], hashed: list[list[int]],
                  prefill: list[WorkerState], decode: list[WorkerState], decisions: int
                  ) -> dict[str, tuple[float, float, float]]:
    """Per policy: (wall p50, wall p99, thread CPU p99) of match + choose, in us."""
    results = {}
    for name in sorted(PLACEMENTS):
        policy = create_placement(name)
        times, cpu = [], []
        for i in range(decisions):
            j = i % len(requests)
            c, t = time.thread_time_ns(), time.perf_counter_ns()
            matched = {w: n * BLOCK_SIZE for w, n in index.match(hashed[j]).items()}
            policy.choose(prefill, decode, i, PlacementRequest(len(requests[j]), matched))
            times.append((time.perf_counter_ns() - t) / 1e3)
            cpu.append((time.thread_time_ns() - c) / 1e3)
        results[name] = (percentile(times, 0.5), percentile(times, 0.99),
                         percentile(cpu, 0.99))
        print(f"{name:13s} decision wall p50 {results[name][0]:7.1f} us  p99 "
              f"{results[name][1]:7.1f} us   (thread CPU p99 {results[name][2]:7.1f} us)")
    return results


def time_snapshots(num_prefill: int, num_decode: int, rounds: int = 5000) -> None:
    """What the dispatcher adds around a decision: gathering every pool worker's
    snapshot (once per decision), and publishing a new one per in-flight hook."""
    infos = static_infos([f"127.0.0.1:{10_000 + i}" for i in range(num_prefill)],
                         [f"127.0.0.1:{20_000 + i}" for i in range(num_decode)])
    workers = [Worker(info) for info in infos]
    gather, hook = [], []
    for i in range(rounds):
        t = time.perf_counter_ns()
        _ = [w.snapshot() for w in workers]
        gather.append((time.perf_counter_ns() - t) / 1e3)
        w = workers[i % len(workers)]
        t = time.perf_counter_ns()
        w.on_sent(100)
        hook.append((time.perf_counter_ns() - t) / 1e3)
        w.on_finished(100)
    print(f"snapshots of {len(workers)} workers per decision: p50 {percentile(gather, 0.5):.1f} "
          f"us, p99 {percentile(gather, 0.99):.1f} us; one hook (new snapshot): p50 "
          f"{percentile(hook, 0.5):.1f} us, p99 {percentile(hook, 0.99):.1f} us")


def time_full(routing: PrefixRouting, requests: list[list[int]], prefill: list[WorkerState],
              decode: list[WorkerState]) -> None:
    full = []
    for i in range(2000):
        t = time.perf_counter()
        req = routing.request(requests[i % len(requests)])
        create_placement("cache_aware").choose(prefill, decode, i, req)
        full.append((time.perf_counter() - t) * 1e6)
    print(f"cache_aware incl. prompt hashing: p50 {percentile(full, 0.5):.1f} us, "
          f"p99 {percentile(full, 0.99):.1f} us")


def run(cfg: PlacementDecisionConfig) -> int:
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores (shared machine)")
    index, prompts, prefill, decode = build(cfg.workers, cfg.blocks, cfg.seed)
    gc.collect()
    gc.freeze()  # the long-lived index out of the collector's way, as a router would do
    requests = make_requests(prompts, cfg.seed + 1)
    t0 = time.perf_counter()
    hashed = [chain_hashes(r, BLOCK_SIZE) for r in requests]
    hash_us = (time.perf_counter() - t0) / len(requests) * 1e6
    print(f"index: {cfg.workers} workers, {index.num_blocks} (worker, block) entries, "
          f"{len(prompts)} distinct 4k-token prefixes; prompts avg "
          f"{statistics.mean(map(len, requests)):.0f} tokens, hashing {hash_us:.0f} us each")
    results = time_policies(index, requests, hashed, prefill, decode, cfg.decisions)
    time_full(PrefixRouting(index, CollectorRegistry()), requests, prefill, decode)
    time_snapshots(len(prefill), len(decode))
    ca, rr = results["cache_aware"], results["round_robin"]
    ca_p99 = min(ca[1:])
    print(f"cache_aware p99 (lower of wall / thread CPU) {ca_p99:.1f} us vs target "
          f"<= {TARGET_P99_US:.0f} us: "
          f"{'OK' if ca_p99 <= TARGET_P99_US else 'MISSED'}; "
          f"ratio to round_robin p99: wall {ca[1] / rr[1]:.2f}x, thread CPU {ca[2] / rr[2]:.2f}x")
    return 0
