"""Cache-aware placement on real vLLM: ``pdserve up`` with 2 prefill workers (KV
events on) and 1 decode worker (``TWO_PREFILL``, shared with the next file,
``test_placement_kv_pool.py``).

A repeated long prefix goes to the prefill worker that computed it (its engine
reports the prefix hit), and a flood of one prefix spills to the other worker once
the holder is loaded."""

from __future__ import annotations

import asyncio
import random
import threading

import httpx
import psutil
import pytest
from integration.clusters import TWO_PREFILL, cluster_id
from pdserve_testing import Server, wait_until

from pdserve.core.types import WorkerLoadReport
from pdserve.router.dispatch.workers.client import probe_load

pytestmark = [pytest.mark.integration,
              pytest.mark.parametrize("pd_server", [TWO_PREFILL], indirect=True, ids=cluster_id)]

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 128


@pytest.fixture
def cluster(pd_server: Server) -> Server:
    """The cluster once the router's prefix index has every worker's KV events, both
    prefill workers' and the decode's (the ``--disagg always`` router places every
    prefill: placement is under test)."""
    assert wait_until(lambda: len(_index(pd_server)["resyncs"]) == 3, 30), _index(pd_server)
    return pd_server


def _index(server: Server) -> dict:
    return httpx.get(server.base_url.removesuffix("/v1") + "/prefix_index", timeout=5).json()


def _prefill_loads(server: Server) -> dict[str, WorkerLoadReport]:
    return {w["id"]: probe_load(w["endpoint"], timeout_s=5, secret=server.secret)
            for w in server.workers("prefill")}


def _prefix(seed: int, words: int = 1100) -> str:
    rng = random.Random(seed)
    vocab = ["river", "mill", "north", "stone", "bridge", "lantern", "harbor", "meadow",
             "copper", "willow", "thunder", "garden", "candle", "orchard", "falcon", "ember"]
    return " ".join(rng.choice(vocab) for _ in range(words))


def _complete(server: Server, prompt: str) -> dict:
    """max_tokens=1: the prefill worker answers alone (placement is what is tested)."""
    resp = httpx.post(server.base_url + "/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    resp.raise_for_status()
    return resp.json()


def _delta(after: dict[str, WorkerLoadReport], before: dict[str, WorkerLoadReport],
           field: str) -> dict[str, int]:
    return {w: getattr(after[w], field) - getattr(before[w], field) for w in after}


def test_repeated_long_prefix_goes_to_the_worker_that_computed_it(cluster: Server) -> None:
    prefix = _prefix(1)
    before = _prefill_loads(cluster)
    first = _complete(cluster, prefix + "\nQuestion 0: which way?")
    computed = _delta(_prefill_loads(cluster), before, "prompt_tokens_computed")
    holder = max(computed, key=computed.__getitem__)
    other = next(w for w in computed if w != holder)
    num_prompt = first["usage"]["prompt_tokens"]
    assert num_prompt > 8 * BLOCK_SIZE and computed[holder] >= num_prompt - BLOCK_SIZE
    # The router's index learns the holder's blocks from its KV events.
    full_blocks = num_prompt // BLOCK_SIZE
    assert wait_until(lambda: _index(cluster)["blocks"].get(holder, 0) >= full_blocks, 10)
    for i in range(1, 4):
        before = _prefill_loads(cluster)
        resp = _complete(cluster, prefix + f"\nQuestion {i}: why {i}?")
        after = _prefill_loads(cluster)
        hits = _delta(after, before, "prompt_tokens_local_cache_hit")
        assert hits[holder] >= (full_blocks - 1) * BLOCK_SIZE, (i, hits)
        assert hits[other] == 0 and _delta(after, before, "prompt_tokens_computed")[other] == 0
        cached = resp["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == hits[holder]  # the response reports the engine's prefix hit
    metrics = httpx.get(cluster.base_url.removesuffix("/v1") + "/metrics", timeout=5).text
    assert "pdserve:prefix_cache_hit_ratio" in metrics


async def _flood(server: Server, prompts: list[str]) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        resps = await asyncio.gather(*(client.post(server.base_url + "/completions", json={
            "model": MODEL, "prompt": p, "max_tokens": 1, "temperature": 0}) for p in prompts))
    assert all(r.status_code == 200 for r in resps), [r.text for r in resps if r.status_code]


def _engines(server: Server, role: str) -> list[psutil.Process]:
    """The engine processes (EngineCore, Worker) of ``up``'s ``role`` workers."""
    out = []
    for child in psutil.Process(server.proc.pid).children():
        argv = child.cmdline()
        if argv[3:4] == [role]:
            out += child.children(recursive=True)
    return out


def _placed_at_once(server: Server, prompts: list[str]) -> None:
    """Send ``prompts`` at once with the prefill engines paused until the router has
    placed every one, so placement sees the whole flood queued however fast this
    machine would have finished the first ones (its workers keep answering probes)."""
    engines = _engines(server, "prefill")
    assert engines
    for e in engines:
        e.suspend()
    errors: list[BaseException] = []

    def send() -> None:
        try:
            asyncio.run(_flood(server, prompts))
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test
            errors.append(exc)

    flood = threading.Thread(target=send)
    try:
        flood.start()
        assert wait_until(lambda: sum(int(w["num_assigned"]) for w in server.workers("prefill"))
                          == len(prompts), 30, 0.05)
    finally:
        for e in engines:
            e.resume()
    flood.join(300)
    assert not flood.is_alive() and not errors, errors


def test_flood_of_one_prefix_spills_to_the_other_worker(cluster: Server) -> None:
    prefix = _prefix(2)
    before = _prefill_loads(cluster)
    num_prompt = _complete(cluster, prefix + "\nWarm up.")["usage"]["prompt_tokens"]
    computed = _delta(_prefill_loads(cluster), before, "prompt_tokens_computed")
    holder = max(computed, key=computed.__getitem__)
    other = next(w for w in computed if w != holder)
    assert wait_until(lambda: _index(cluster)["blocks"].get(holder, 0)
                      >= num_prompt // BLOCK_SIZE, 10)
    before = _prefill_loads(cluster)
    _placed_at_once(cluster, [prefix + f"\nRequest {i}: go." for i in range(16)])
    after = _prefill_loads(cluster)
    hits = _delta(after, before, "prompt_tokens_local_cache_hit")
    computed = _delta(after, before, "prompt_tokens_computed")
    served = {w: hits[w] + computed[w] for w in hits}  # prompt tokens each worker took
    per_request = num_prompt + 5
    # The holder served most of the flood from its cache; the other computed the prefix too.
    assert served[holder] >= 8 * per_request * 0.9, served
    assert computed[other] >= num_prompt - 2 * BLOCK_SIZE, computed
    assert hits[holder] >= 8 * (num_prompt // BLOCK_SIZE - 1) * BLOCK_SIZE, hits
