"""The decode-side prefix cache on real vLLM (``TWO_PREFILL``: ``--disagg always``, KV
pulled, after ``test_placement_e2e.py``, before ``test_placement_kv_pool.py``).

A conversation's second turn, served remote, goes to the decode worker that holds the
first (the router follows decode's KV events too), and that worker loads only the
blocks past what its own prefix cache holds: the new turn's. The KV counters of both
ends say so, and the greedy text equals one aggregated engine's."""

from __future__ import annotations

import random

import httpx
import pytest
from integration.clusters import TWO_PREFILL, cluster_id
from pdserve_testing import Server, wait_until

from pdserve.core.types import WorkerLoadReport
from pdserve.router.dispatch.workers.client import probe_load

pytestmark = [pytest.mark.integration,
              pytest.mark.parametrize("pd_server", [TWO_PREFILL], indirect=True, ids=cluster_id)]

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 128


def _index(server: Server) -> dict:
    return httpx.get(server.base_url.removesuffix("/v1") + "/prefix_index", timeout=5).json()


def _loads(server: Server, role: str) -> dict[str, WorkerLoadReport]:
    return {w["id"]: probe_load(w["endpoint"], timeout_s=5, secret=server.secret)
            for w in server.workers(role)}


def _bytes(server: Server) -> tuple[int, int]:
    """(bytes every prefill worker sent, bytes the decode worker received)."""
    sent = sum(load.kv_bytes_sent for load in _loads(server, "prefill").values())
    return sent, server.load("decode").kv_bytes_received


def _complete(base_url: str, prompt: list[int], max_tokens: int) -> dict:
    resp = httpx.post(base_url + "/completions", timeout=180, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    resp.raise_for_status()
    return resp.json()


def _words(tokenizer: object, seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    vocab = ["amber", "quay", "slate", "fern", "cobalt", "drift", "lattice", "hollow",
             "meridian", "saffron", "tundra", "vessel", "wicker", "zephyr", "oak", "brine"]
    ids = tokenizer.encode(" ".join(rng.choice(vocab) for _ in range(num_tokens)))  # type: ignore[attr-defined]
    return ids[:num_tokens]


def test_second_turn_loads_only_the_new_blocks_from_prefill(
        pd_server: Server, vllm_openai: str, tokenizer: object) -> None:
    server = pd_server
    # Both prefills' and the decode's KV events reach the router's index.
    assert wait_until(lambda: len(_index(server)["resyncs"]) == 3, 30), _index(server)
    (decode,) = server.workers("decode")
    first = _words(tokenizer, 1, 3 * BLOCK_SIZE + 40)
    sent0, received0 = _bytes(server)
    one = _complete(server.base_url, first, 24)
    sent1, received1 = _bytes(server)
    blocks_one = -(-len(first) // BLOCK_SIZE)  # every block of the prompt, the last partial
    per_block = (received1 - received0) // blocks_one
    assert per_block > 0 and received1 - received0 == blocks_one * per_block
    assert sent1 - sent0 == received1 - received0  # what prefill sent, decode received
    # The decode engine announced the blocks it loaded and the full ones it generated.
    answer = one["choices"][0]["token_ids"]
    held = (len(first) + len(answer) - 1) // BLOCK_SIZE  # full blocks of computed tokens
    assert wait_until(lambda: _index(server)["blocks"].get(decode["id"], 0) >= held, 10), (
        _index(server), held)
    second = [*first, *answer, *_words(tokenizer, 2, BLOCK_SIZE + 20)]
    two = _complete(server.base_url, second, 24)
    sent2, received2 = _bytes(server)
    new_blocks = -(-len(second) // BLOCK_SIZE) - held
    assert 0 < received2 - received1 <= new_blocks * per_block, (
        received2 - received1, new_blocks, per_block)
    assert sent2 - sent1 == received2 - received1
    # Served remote like the first turn, and its text is one engine's greedy text.
    reference = _complete(vllm_openai, second, 24)
    assert two["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
    assert two["choices"][0]["text"] == reference["choices"][0]["text"]
