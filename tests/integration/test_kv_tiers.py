"""The KV tiers on real vLLM engines: a prompt computed once, then evicted from a
small engine cache by other prompts, comes back from the host tier, or from the disk
tier once the host tier has evicted it too (the worker's counters and vLLM's own
prompt-token sources say so), with the same greedy text as one aggregated vLLM
engine; a corrupt disk block ends in a counted recompute with the same text; a tier
block comes back under the ``cache_salt`` that computed it, never another."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from integration.clusters import STARTUP_TIMEOUT_S
from integration.pd_cases import MODEL
from pdserve_testing import Server, kill_cluster, launch_up, wait_until

from pdserve.core.ports import free_port

pytestmark = pytest.mark.integration

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
NUM_KV_BLOCKS = 8  # the prefill engine's cache: two of these prompts fill it
HOST_GIB = 0.1  # 17 blocks of float32 SmolLM2 (5.9 MB each): five prompts' worth
DISK_GIB = 0.3  # 54 blocks: every prompt of this module


def _prompt(tag: str) -> str:
    """~440 tokens: three full blocks of 128 and a partial one."""
    return tag + ": " + " ".join(WORDS[(i * 7 + len(tag)) % len(WORDS)] for i in range(330))


@pytest.fixture(scope="module")
def tier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def tier_server(model_path: Path, tmp_path_factory: pytest.TempPathFactory, tier_dir: Path
                ) -> Iterator[Server]:
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PDSERVE_CACHE=os.environ.get("PDSERVE_CACHE", str(model_path.parents[1])))
    server = launch_up(
        ["--dtype", "float32", "--port", str(free_port()), "--kv-cache-gib", "1",
         "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", "768",
         "--kv-offload-gib", str(HOST_GIB), "--kv-disk-dir", str(tier_dir),
         "--kv-disk-gib", str(DISK_GIB), "--kv-checksum", "--disagg", "always"], env,
        STARTUP_TIMEOUT_S, log_path=tmp_path_factory.mktemp("up-tier") / "up.log")
    try:
        yield server
    finally:
        kill_cluster(server.proc)


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


def _evict_from_engine_and_host(url: str, tag: str) -> None:
    """Six other prompts: the engine (8 blocks) and the host tier (17) lose ``tag``'s."""
    for i in range(6):
        _complete(url, _prompt(f"{tag}{i}"))


def test_a_prefix_the_host_tier_lost_loads_from_disk(tier_server: Server,
                                                     vllm_openai: str) -> None:
    url = tier_server.base_url
    first = _complete(url, _prompt("E"))
    _evict_from_engine_and_host(url, "e")
    before = tier_server.load("prefill")
    again = _complete(url, _prompt("E"))
    after = tier_server.load("prefill")
    assert after.kv_disk_loads - before.kv_disk_loads == 1
    assert after.kv_disk_load_blocks - before.kv_disk_load_blocks >= 2
    assert after.kv_disk_load_failures == before.kv_disk_load_failures
    assert first == again == _complete(vllm_openai, _prompt("E"))


def test_a_corrupt_disk_block_is_recomputed_with_the_same_text(
    tier_server: Server, vllm_openai: str, tier_dir: Path,
) -> None:
    url = tier_server.base_url
    # Once the last test's saves are done (a save holds its request's blocks): only F's
    # then moves the count, and only F's files are newer than start_ns.
    assert wait_until(tier_server.idle, timeout_s=30), tier_server.holding()
    saved = tier_server.load("prefill").kv_disk_saves
    start_ns = time.time_ns()
    first = _complete(url, _prompt("F"))
    assert wait_until(lambda: tier_server.load("prefill").kv_disk_saves > saved, timeout_s=15)
    files = [p for p in (tier_dir / "prefill-0").rglob("*.kv") if p.stat().st_mtime_ns >= start_ns]
    assert len(files) >= 2  # F's full blocks
    _evict_from_engine_and_host(url, "f")  # 18 more blocks: F's files are not reused (54)
    for path in files:  # one flipped byte near the end of each of F's blocks
        raw = bytearray(path.read_bytes())
        raw[-64] ^= 0xFF
        path.write_bytes(raw)
    before = tier_server.load("prefill")
    again = _complete(url, _prompt("F"))
    after = tier_server.load("prefill")
    assert after.kv_disk_load_failures - before.kv_disk_load_failures == 1  # counted
    assert after.kv_disk_loads == before.kv_disk_loads
    assert after.prompt_tokens_computed - before.prompt_tokens_computed >= 2 * 128
    assert first == again == _complete(vllm_openai, _prompt("F"))


def _cached_tokens(base_url: str, prompt: str, salt: str) -> int:
    reply = httpx.post(f"{base_url}/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "cache_salt": salt})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_tier_block_comes_back_under_its_own_salt_only(tier_server: Server,
                                                         tokenizer: Any) -> None:
    """Forced from the host tier: a prompt computed and saved under salt A is evicted
    from the 8-block engine cache by three other prompts (as in the first test), so
    salt A's next request can only find it in the tier. Salt B's same tokens then find
    nothing there (the tier names blocks by vLLM's salted hashes): no tier or disk
    load, every token computed, 0 cached tokens."""
    url, prompt = tier_server.base_url, _prompt("salted-G")
    num_tokens = len(tokenizer(prompt).input_ids)
    num_full = (num_tokens - 1) // 128
    saved = tier_server.load("prefill").kv_tier_saves
    assert _cached_tokens(url, prompt, "tenant-a") == 0
    assert wait_until(lambda: tier_server.load("prefill").kv_tier_saves > saved, timeout_s=15)
    for tag in ("g0", "g1", "g2"):
        _complete(url, _prompt(tag))
    evicted = tier_server.load("prefill")
    assert _cached_tokens(url, prompt, "tenant-a") == num_full * 128
    loaded = tier_server.load("prefill")
    assert loaded.kv_tier_loads - evicted.kv_tier_loads == 1
    assert loaded.kv_tier_load_blocks - evicted.kv_tier_load_blocks == num_full >= 2
    assert loaded.prompt_tokens_local_cache_hit == evicted.prompt_tokens_local_cache_hit

    assert _cached_tokens(url, prompt, "tenant-b") == 0
    after = tier_server.load("prefill")
    assert (after.kv_tier_loads, after.kv_disk_loads) == (loaded.kv_tier_loads,
                                                          loaded.kv_disk_loads)
    assert after.prompt_tokens_external == loaded.prompt_tokens_external
    assert after.prompt_tokens_local_cache_hit == loaded.prompt_tokens_local_cache_hit
    assert after.prompt_tokens_computed - loaded.prompt_tokens_computed == num_tokens
