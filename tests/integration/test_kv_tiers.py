"""The host tier on real vLLM engines: a prompt computed once, then evicted from a
small engine cache by other prompts, comes back from the host tier (the worker's
counters and vLLM's own prompt-token sources say so) with the same greedy text as
one aggregated vLLM engine."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from integration.conftest import STARTUP_TIMEOUT_S
from integration.pd_cases import MODEL
from pdserve_testing import Server, launch_up, stop_up, wait_until

from pdserve.core.ports import free_port

pytestmark = pytest.mark.integration

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
NUM_KV_BLOCKS = 8  # the prefill engine's cache: two of these prompts fill it


def _prompt(tag: str) -> str:
    """~440 tokens: three full blocks of 128 and a partial one."""
    return tag + ": " + " ".join(WORDS[(i * 7 + len(tag)) % len(WORDS)] for i in range(330))


@pytest.fixture(scope="module")
def tier_server(model_path: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[Server]:
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PDSERVE_CACHE=os.environ.get("PDSERVE_CACHE", str(model_path.parents[1])))
    server = launch_up(
        ["--dtype", "float32", "--port", str(free_port()), "--kv-cache-gib", "1",
         "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", "768",
         "--kv-offload-gib", "0.25", "--kv-checksum", "--disagg", "always"], env,
        STARTUP_TIMEOUT_S, log_path=tmp_path_factory.mktemp("up-tier") / "up.log")
    try:
        yield server
    finally:
        stop_up(server.proc)


def _complete(base_url: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="none", timeout=120)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                      temperature=0)
    return reply.choices[0].text


def test_an_evicted_prefix_loads_from_the_host_tier_with_aggregated_equal_text(
    tier_server: Server, vllm_openai: str, tokenizer: Any,
) -> None:
    url = tier_server.base_url
    num_tokens = len(tokenizer(_prompt("A")).input_ids)
    num_full = (num_tokens - 1) // 128  # the prompt's last token is always computed
    before = tier_server.load("prefill")
    first = _complete(url, _prompt("A"))
    assert wait_until(lambda: tier_server.load("prefill").kv_tier_saves > before.kv_tier_saves,
                      timeout_s=15)
    for tag in ("B", "C", "D"):  # each fills most of the 8-block cache: A is evicted
        _complete(url, _prompt(tag))
    evicted = tier_server.load("prefill")
    again = _complete(url, _prompt("A"))
    after = tier_server.load("prefill")

    assert after.kv_tier_loads - evicted.kv_tier_loads == 1
    assert after.kv_tier_load_blocks - evicted.kv_tier_load_blocks == num_full >= 2
    assert after.kv_tier_load_failures == before.kv_tier_load_failures  # checksummed, clean
    # vLLM counts the loaded tokens as external, not computed: only the tail is computed
    assert after.prompt_tokens_external - evicted.prompt_tokens_external == num_full * 128
    assert (after.prompt_tokens_computed - evicted.prompt_tokens_computed
            == num_tokens - num_full * 128)
    assert after.prompt_tokens_local_cache_hit == evicted.prompt_tokens_local_cache_hit
    assert first == again == _complete(vllm_openai, _prompt("A"))
