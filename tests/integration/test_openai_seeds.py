"""Seeded sampling under load on the shared tcp cluster: RL rollouts send a ``seed``
with every sample, many at once. The decode worker then computes their prompts in
chunks beside each other (its step budget), and vLLM on CPU used to die there (its
rewind of a seeded request's generator, ``pdserve.worker.vllm.plugin``). Every request
succeeds, and a seeded request's text does not depend on what ran beside it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from integration.pd_cases import MODEL
from pdserve_testing import Server

pytestmark = pytest.mark.integration

NUM_REQUESTS = 16
# ~200 tokens each: local prompts (under the cluster's --local-prefill-max-tokens), 16 at
# once: more prompt tokens than one engine step takes, so some are computed in chunks.
TOPICS = ("rivers", "mountains", "the sea", "deserts", "forests", "cities", "islands",
          "volcanoes")


def _prompt(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    facts = " ".join(f"Fact {k} about {topic}: they change slowly over the years."
                     for k in range(14))
    return f"{facts} Request {i}: write one sentence about {topic}."


def _chat(server: Server, i: int) -> dict[str, Any]:
    r = httpx.post(server.base_url + "/chat/completions", timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": _prompt(i)}],
        "max_tokens": 16, "temperature": 1.0, "seed": 1000 + i})
    assert r.status_code == 200, r.text
    return r.json()


def test_seeded_requests_computed_in_chunks_side_by_side_all_succeed_and_repeat(
        pd_server: Server) -> None:
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        together = list(pool.map(lambda i: _chat(pd_server, i), range(NUM_REQUESTS)))
    assert all(r["choices"][0]["finish_reason"] in ("stop", "length") for r in together)
    for i in (0, NUM_REQUESTS - 1):  # alone now: the same seed, the same text
        alone = _chat(pd_server, i)
        assert alone["choices"][0]["message"]["content"] == \
            together[i]["choices"][0]["message"]["content"]
