"""The cluster KV pool on real vLLM engines: a prompt computed on one prefill worker
(written through to its host tier) is loaded by the other prefill worker from that
host tier over the KV transport, not recomputed (both workers' counters say so),
and the decode's greedy text is one aggregated vLLM engine's; a peer killed in the
middle of such a pull ends in a counted recompute with the same text; a prefix
computed under one ``cache_salt`` is pulled for that salt only.

The prefills are sent to the workers directly, as the router's dispatch sends them
with a pool source (which worker the router picks is tested on simulated workers):
that pins the computing and the pulling worker. The cluster is ``TWO_PREFILL``, shared
with ``test_placement_e2e.py``: this file sorts after it, since its last test kills a
worker."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from typing import Any

import openai
import psutil
import pytest
from integration.clusters import TWO_PREFILL, cluster_id
from integration.pd_cases import MODEL
from pdserve_testing import Server, wait_until

from pdserve.core.handle import PoolSource
from pdserve.core.types import PhaseRequest, SamplingSpec, WorkerLoadReport
from pdserve.kv_transfer.control.dial import request_once
from pdserve.router.dispatch.workers.client import WorkerClient, probe_health, probe_load

pytestmark = [pytest.mark.integration,
              pytest.mark.parametrize("pd_server", [TWO_PREFILL], indirect=True, ids=cluster_id)]

WORDS = "north south east west up down left right near far high low".split()
BS = 128
MAX_TOKENS = 8
# The cluster paces sends to 8 MiB/s: a 3-block pool pull of float32 SmolLM2 (5.9 MB a
# block) takes ~2 s, long enough to kill the serving worker in its middle (the test
# waits for the send to start, polling every 50 ms).
REJOIN_TIMEOUT_S = 240


def _prompt(tag: str) -> str:
    """~440 tokens: three full blocks of 128 and a partial one."""
    return tag + ": " + " ".join(WORDS[(i * 5 + len(tag)) % len(WORDS)] for i in range(330))


@pytest.fixture
def pool_server(pd_server: Server) -> Server:
    _SECRET[0] = pd_server.secret
    return pd_server


def _prefills(server: Server) -> list[dict[str, Any]]:
    """Both prefill workers, healthy (one may be back from a kill by an earlier test)."""
    def both() -> list[dict[str, Any]] | None:
        workers = sorted(server.workers("prefill"), key=lambda w: w["id"])
        return workers if len(workers) == 2 and all(w["healthy"] for w in workers) else None

    workers = wait_until(both, REJOIN_TIMEOUT_S, 1.0)
    assert workers, server.log_lines("prefill", "exited", "restart")
    return workers


_SECRET: list[Any] = [None]  # the cluster's secret (direct calls to workers need it)


def _load(worker: dict[str, Any]) -> WorkerLoadReport:
    return probe_load(worker["endpoint"], timeout_s=5, secret=_SECRET[0])


def _source(worker: dict[str, Any], num_blocks: int) -> PoolSource:
    """The worker's KV endpoint (its Health says where), holding ``num_blocks``."""
    health = probe_health(worker["endpoint"], timeout_s=5, secret=_SECRET[0])
    return PoolSource(health.kv_host, health.kv_port, num_blocks, worker["id"])


async def _phase(endpoint: str, request: PhaseRequest) -> tuple[list[int], Any]:
    client = WorkerClient(endpoint, _SECRET[0])
    try:
        tokens: list[int] = []
        handle = None
        async for out in client.generate(request, timeout_s=180):
            tokens += out.token_ids
            handle = out.kv_handle or handle
        return tokens, handle
    finally:
        await client.close()


def _serve(server: Server, prefill: dict[str, Any], ids: list[int], tag: str,
           pool: PoolSource | None = None) -> list[int]:
    """Prefill ``ids`` on ``prefill`` (pulling from ``pool``), decode it on the decode
    worker with the prefill's KV handle, as the router's dispatch does: the token ids."""
    sampling = SamplingSpec(max_tokens=MAX_TOKENS, temperature=0.0)
    first, handle = asyncio.run(_phase(prefill["endpoint"], PhaseRequest(
        f"pool-{tag}-{time.monotonic_ns()}", "prefill", tuple(ids), sampling,
        pool_source=pool)))
    assert len(first) == 1 and handle is not None
    (decode,) = server.workers("decode")
    rest, _ = asyncio.run(_phase(decode["endpoint"], PhaseRequest(
        f"pool-{tag}-d-{time.monotonic_ns()}", "decode", (*ids, *first),
        SamplingSpec(max_tokens=MAX_TOKENS - 1, temperature=0.0), kv_handle=handle,
        num_output_in_prompt=1)))
    return first + rest


def _compute_on(prefill: dict[str, Any], ids: list[int], salt: str | None = None) -> None:
    """Compute ``ids`` (under ``salt``) on ``prefill`` alone (one token, no KV kept for
    a decode) and wait until its blocks are in its host tier. It starts once the worker
    holds no block: a save holds its request's blocks, and one left from an earlier test
    (the cluster served others first) would move the count too."""
    assert wait_until(lambda: _load(prefill).kv_cache_usage == 0.0, timeout_s=30)
    before = _load(prefill).kv_tier_save_blocks
    asyncio.run(_phase(prefill["endpoint"], PhaseRequest(
        f"pool-seed-{time.monotonic_ns()}", "prefill", tuple(ids),
        SamplingSpec(max_tokens=1, temperature=0.0, cache_salt=salt))))
    assert wait_until(lambda: _load(prefill).kv_tier_save_blocks > before, timeout_s=30)


def _reference(vllm_openai: str, ids: list[int], tokenizer: Any) -> str:
    client = openai.OpenAI(base_url=vllm_openai, api_key="none", timeout=120)
    reply = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS,
                                      temperature=0)
    return reply.choices[0].text


def _held_prefix(server: Server, tokenizer: Any, letter: str, salt: str | None = None
                 ) -> tuple[dict[str, Any], dict[str, Any], list[int], int]:
    """One prefill worker (the holder) computes a fresh prompt (under ``salt``); the
    other (the puller) does not hold it. Returns both, the prompt's ids and its number
    of full blocks."""
    holder, puller = _prefills(server)
    ids = list(tokenizer(_prompt(letter)).input_ids)
    _compute_on(holder, ids, salt)
    return holder, puller, ids, (len(ids) - 1) // BS


def test_another_worker_loads_a_prefix_through_the_pool_with_aggregated_equal_text(
    pool_server: Server, vllm_openai: str, tokenizer: Any,
) -> None:
    holder, puller, ids, num_full = _held_prefix(pool_server, tokenizer, "P")
    held, pulled = _load(holder), _load(puller)
    tokens = _serve(pool_server, puller, ids, "ok", _source(holder, num_full))
    after_held, after_pulled = _load(holder), _load(puller)
    assert after_pulled.kv_pool_loads == pulled.kv_pool_loads + 1
    assert after_pulled.kv_pool_load_blocks - pulled.kv_pool_load_blocks == num_full
    assert after_pulled.kv_pool_load_bytes > pulled.kv_pool_load_bytes
    assert after_pulled.kv_pool_load_failures == pulled.kv_pool_load_failures
    assert after_held.kv_pool_serve_blocks - held.kv_pool_serve_blocks == num_full
    # vLLM counted the pulled tokens as external, not computed.
    assert (after_pulled.prompt_tokens_external - pulled.prompt_tokens_external
            == num_full * BS)
    assert tokenizer.decode(tokens) == _reference(vllm_openai, ids, tokenizer)


def _cached_on(prefill: dict[str, Any], ids: list[int], salt: str, pool: PoolSource) -> int:
    """Prefill ``ids`` under ``salt`` on ``prefill`` alone, told to pull from ``pool``
    (one token, no KV kept for a decode): the cached tokens it reports."""
    async def run() -> int:
        client = WorkerClient(prefill["endpoint"], _SECRET[0])
        try:
            outputs = [out async for out in client.generate(PhaseRequest(
                f"pool-salt-{time.monotonic_ns()}", "prefill", tuple(ids),
                SamplingSpec(max_tokens=1, temperature=0.0, cache_salt=salt),
                pool_source=pool), timeout_s=180)]
        finally:
            await client.close()
        return outputs[0].num_cached_tokens

    return asyncio.run(run())


def test_a_pool_pull_serves_the_salt_that_computed_the_prefix_only(
    pool_server: Server, tokenizer: Any,
) -> None:
    """Forced through the pool: the holder computes the prompt under salt A (written
    through to its host tier), and the puller, which never saw it, is told to pull it
    from the holder, as the router's dispatch does with a pool source. Salt A's request
    pulls every full block (cached tokens > 0). Salt B's request, with the same tokens
    and the same pool source (which the router would not plan: its index names blocks
    per salt), asks for B's block names (vLLM's salted hashes), which the holder does
    not hold: it refuses the pull (a failure both sides count), no block or byte is
    pulled or served, and the puller computes every token and reports 0 cached."""
    holder, puller, ids, num_full = _held_prefix(pool_server, tokenizer, "S", "tenant-a")
    source = _source(holder, num_full)
    held, pulled = _load(holder), _load(puller)
    assert _cached_on(puller, ids, "tenant-a", source) == num_full * BS
    after_held, after_pulled = _load(holder), _load(puller)
    assert after_pulled.kv_pool_loads == pulled.kv_pool_loads + 1
    assert after_pulled.kv_pool_load_blocks - pulled.kv_pool_load_blocks == num_full >= 2
    assert after_held.kv_pool_serve_blocks - held.kv_pool_serve_blocks == num_full

    assert _cached_on(puller, ids, "tenant-b", source) == 0
    last_held, last_pulled = _load(holder), _load(puller)
    assert last_pulled.kv_pool_loads == after_pulled.kv_pool_loads
    assert last_pulled.kv_pool_load_blocks == after_pulled.kv_pool_load_blocks
    assert last_pulled.kv_pool_load_bytes == after_pulled.kv_pool_load_bytes
    assert last_held.kv_pool_serve_blocks == after_held.kv_pool_serve_blocks
    # The holder refused the names it does not hold; the puller counted the failure.
    assert last_held.kv_pool_serve_failures == after_held.kv_pool_serve_failures + 1
    assert last_pulled.kv_pool_load_failures == after_pulled.kv_pool_load_failures + 1
    assert last_pulled.prompt_tokens_external == after_pulled.prompt_tokens_external
    assert last_pulled.prompt_tokens_computed - after_pulled.prompt_tokens_computed == len(ids)


def _engine_of(worker_id: str, server: Server) -> list[psutil.Process]:
    """The worker's process and everything under it (its engine serves the KV port)."""
    for p in psutil.Process(server.proc.pid).children():
        try:
            argv = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "--worker-id" in argv and argv[argv.index("--worker-id") + 1] == worker_id:
            return [p, *p.children(recursive=True)]
    raise AssertionError(f"no process for {worker_id}")


def test_a_peer_killed_mid_pull_ends_in_a_recompute_with_the_same_text(
    pool_server: Server, vllm_openai: str, tokenizer: Any,
) -> None:
    holder, puller, ids, num_full = _held_prefix(pool_server, tokenizer, "K")
    source = _source(holder, num_full)
    pulled = _load(puller)
    victims = _engine_of(holder["id"], pool_server)
    result: dict[str, Any] = {}

    def serve() -> None:
        try:
            result["tokens"] = _serve(pool_server, puller, ids, "kill", source)
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    thread = threading.Thread(target=serve)
    thread.start()
    def status() -> dict[str, Any]:
        return request_once(source.host, source.port, {"op": "status"}, 5, _SECRET[0])

    sending = wait_until(lambda: status().get("num_sending", 0) > 0, timeout_s=60,
                         interval_s=0.05)
    assert sending, "the pool pull never started"
    for p in victims:
        p.send_signal(signal.SIGKILL)
    thread.join(300)
    assert not thread.is_alive() and "error" not in result, result
    after = _load(puller)
    assert after.kv_pool_load_failures == pulled.kv_pool_load_failures + 1
    assert after.kv_pool_loads == pulled.kv_pool_loads
    assert tokenizer.decode(result["tokens"]) == _reference(vllm_openai, ids, tokenizer)
