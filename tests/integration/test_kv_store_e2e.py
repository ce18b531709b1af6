"""The cluster KV store on real vLLM engines (2 prefill + 1 decode, float32, small
engine caches, no host tier) with a real ``redis-server``: a prompt computed on one
prefill worker is served from the store on the other (cached tokens counted, text equal
to one aggregated vLLM engine), never under another salt or weight version; and the
store's faults (a corrupt value, a block lost between the lookup and the load, a full
store, a store stopped past the lookup's deadline, the store killed) each end in a
counted miss and the same text, status 200; a block lost at load time keeps the blocks
before it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
from integration.clusters import STARTUP_TIMEOUT_S
from integration.pd_cases import MODEL
from pdserve_testing import Server, kill_cluster, launch_up, wait_until

from pdserve.core.ports import free_port
from pdserve.core.types import WorkerLoadReport
from pdserve.kv_transfer.remote import codec
from pdserve.kv_transfer.remote.local_redis import LocalRedis
from pdserve.router.dispatch.workers.client import probe_load

pytestmark = pytest.mark.integration

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
NUM_KV_BLOCKS = 8  # each engine's cache: two of these prompts evict a third
KEY_GLOB = "pdserve:kv:v1:*"


def _prompt(tag: str) -> str:
    """~440 tokens: three full blocks of 128 and a partial one."""
    return tag + ": " + " ".join(WORDS[(i * 5 + len(tag)) % len(WORDS)] for i in range(330))


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    with LocalRedis(maxmemory="512mb", log_path=tmp_path_factory.mktemp("redis") / "r.log"
                    ) as server:
        yield server


@pytest.fixture(scope="module")
def store_server(model_path: Path, tmp_path_factory: pytest.TempPathFactory,
                 redis_server: LocalRedis) -> Iterator[Server]:
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PDSERVE_CACHE=os.environ.get("PDSERVE_CACHE", str(model_path.parents[1])))
    admin_port = free_port()
    server = launch_up(
        ["--dtype", "float32", "--port", str(free_port()), "--admin-port", str(admin_port),
         "--kv-cache-gib", "1",
         "--num-prefill", "2", "--num-decode", "1",
         "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", "768",
         "--kv-store", redis_server.url, "--kv-store-timeout-s", "0.5",
         "--disagg", "always"], env,
        STARTUP_TIMEOUT_S, log_path=tmp_path_factory.mktemp("up-store") / "up.log")
    try:
        yield replace(server, admin_url=f"http://127.0.0.1:{admin_port}")
    finally:
        kill_cluster(server.proc)


def _complete(base_url: str, prompt: str, salt: str | None = None) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="none", timeout=120)
    extra = {"cache_salt": salt} if salt is not None else None
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                      temperature=0, extra_body=extra)
    return reply.choices[0].text


def _prefills(server: Server) -> dict[str, WorkerLoadReport]:
    return {w["id"]: probe_load(w["endpoint"], timeout_s=5, secret=server.secret,
                                       tls=server.tls)
            for w in server.workers("prefill")}


def _total(loads: dict[str, WorkerLoadReport], field: str) -> int:
    return sum(getattr(r, field) for r in loads.values())


def _delta(before: dict[str, WorkerLoadReport], after: dict[str, WorkerLoadReport],
           field: str) -> dict[str, int]:
    return {w: getattr(after[w], field) - getattr(before[w], field) for w in after
            if w in before}


def _published(redis_server: LocalRedis, count: int) -> bool:
    return len(redis_server.client().keys(KEY_GLOB)) >= count


def _evict(url: str, tag: str) -> None:
    """Two other prompts fill the sole prefill's 8-block cache."""
    for i in range(2):
        _complete(url, _prompt(f"{tag}{i}"))


@pytest.fixture(scope="module")
def one_prefill(store_server: Server, redis_server: LocalRedis, vllm_openai: str
                ) -> dict[str, Any]:
    """Prompt A computed on one prefill worker, which then turns decode: the other
    prefill serves A from the store. What it measured, for the tests below."""
    url = store_server.base_url
    before = _prefills(store_server)
    first = _complete(url, _prompt("A"))
    assert wait_until(lambda: _published(redis_server, 3), timeout_s=20)
    saved = _delta(before, _prefills(store_server), "kv_store_save_blocks")
    (computed_on,) = [w for w, n in saved.items() if n >= 3]
    r = httpx.post(f"{store_server.admin_url}/admin/workers/{computed_on}/role",
                   json={"role": "decode"},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert wait_until(lambda: len(store_server.workers("prefill")) == 1, timeout_s=30)
    (other,) = [w["id"] for w in store_server.workers("prefill")]
    loads = _prefills(store_server)
    again = _complete(url, _prompt("A"))
    after = _prefills(store_server)
    return {"first": first, "again": again, "oracle": _complete(vllm_openai, _prompt("A")),
            "before": loads, "after": after, "other": other, "computed_on": computed_on}


def test_a_prompt_computed_on_one_prefill_is_served_from_the_store_on_the_other(
        one_prefill: dict[str, Any], tokenizer: Any) -> None:
    before, after, other = one_prefill["before"], one_prefill["after"], one_prefill["other"]
    assert other != one_prefill["computed_on"]
    num_full = (len(tokenizer(_prompt("A")).input_ids) - 1) // 128
    assert _delta(before, after, "kv_store_load_blocks")[other] == num_full >= 3
    assert _delta(before, after, "kv_store_fetch_chosen")[other] == 1
    assert _delta(before, after, "kv_store_load_failures")[other] == 0
    # vLLM counts the loaded tokens as external (cached), the tail as computed
    assert _delta(before, after, "prompt_tokens_external")[other] == num_full * 128
    assert one_prefill["first"] == one_prefill["again"] == one_prefill["oracle"]


def test_another_salt_finds_nothing_in_the_store(store_server: Server,
                                                 one_prefill: dict[str, Any],
                                                 vllm_openai: str) -> None:
    url = store_server.base_url
    before = _prefills(store_server)
    text = _complete(url, _prompt("A"), salt="someone-else")
    after = _prefills(store_server)
    assert _total(after, "kv_store_lookups") > _total(before, "kv_store_lookups")
    assert _total(after, "kv_store_hit_blocks") == _total(before, "kv_store_hit_blocks")
    assert _total(after, "kv_store_load_blocks") == _total(before, "kv_store_load_blocks")
    assert text == one_prefill["oracle"]  # a salt changes the cache, never the text


def test_a_corrupt_value_is_a_counted_miss_and_the_text_is_one_engines(
        store_server: Server, redis_server: LocalRedis, one_prefill: dict[str, Any],
        vllm_openai: str) -> None:
    url = store_server.base_url
    client = redis_server.client()
    known = set(client.keys(KEY_GLOB))
    _complete(url, _prompt("C"))
    assert wait_until(lambda: len(set(client.keys(KEY_GLOB)) - known) >= 3, timeout_s=20)
    for key in set(client.keys(KEY_GLOB)) - known:  # C's blocks: a byte flipped in each
        raw = client.get(key)
        assert isinstance(raw, bytes)
        value = bytearray(raw)
        value[len(value) // 2] ^= 0x55
        client.set(key, bytes(value))
    _evict(url, "c")
    before = _prefills(store_server)
    text = _complete(url, _prompt("C"))
    after = _prefills(store_server)
    assert _total(after, "kv_store_bad_blocks") > _total(before, "kv_store_bad_blocks")
    assert _total(after, "kv_store_load_failures") == _total(before, "kv_store_load_failures") + 1
    assert _total(after, "kv_store_load_blocks") == _total(before, "kv_store_load_blocks")
    # the bad values were deleted: the next writer can publish good ones
    assert _total(after, "kv_store_bad_deleted") > _total(before, "kv_store_bad_deleted")
    assert text == _complete(vllm_openai, _prompt("C"))


def test_a_block_lost_at_load_keeps_the_blocks_before_it_and_the_text_is_one_engines(
        store_server: Server, redis_server: LocalRedis, one_prefill: dict[str, Any],
        vllm_openai: str, tokenizer: Any) -> None:
    """The lookup finds all three blocks, the load finds the third gone (a value whose
    checksum fails reads exactly as one deleted since the lookup: missing): the first two
    load, vLLM recomputes from the third."""
    url = store_server.base_url
    long = _prompt("L")
    short = long[:long.index(" ", 1300)]  # two full blocks, then the long one's third
    short_ids, long_ids = tokenizer(short).input_ids, tokenizer(long).input_ids
    assert (len(short_ids) - 1) // 128 == 2 and (len(long_ids) - 1) // 128 == 3
    assert short_ids[:256] == long_ids[:256]
    client = redis_server.client()
    earlier = set(client.keys(KEY_GLOB))
    _complete(url, short)
    assert wait_until(lambda: len(set(client.keys(KEY_GLOB)) - earlier) >= 2, timeout_s=20)
    known = set(client.keys(KEY_GLOB))
    _complete(url, long)  # publishes its third block only: the first two are held
    assert wait_until(lambda: len(set(client.keys(KEY_GLOB)) - known) >= 1, timeout_s=20)
    (third,) = set(client.keys(KEY_GLOB)) - known
    assert isinstance(third, bytes)
    raw = client.get(third)
    assert isinstance(raw, bytes)
    value = bytearray(raw)
    value[len(value) // 2] ^= 0x55
    client.set(third, bytes(value))
    _evict(url, "l")
    before = _prefills(store_server)
    text = _complete(url, long)
    after = _prefills(store_server)
    assert _total(after, "kv_store_load_blocks") - _total(before, "kv_store_load_blocks") == 2
    assert _total(after, "kv_store_load_failures") - _total(before,
                                                           "kv_store_load_failures") == 1
    assert _total(after, "kv_store_bad_deleted") - _total(before, "kv_store_bad_deleted") == 1
    assert _total(after, "prompt_tokens_external") - _total(
        before, "prompt_tokens_external") >= 2 * 128
    # deleted, then published again, good, by the prefill that recomputed it
    assert wait_until(lambda: codec.decode(third.decode(), cast(bytes, client.get(third) or b""))
                      is not None, timeout_s=20)
    assert text == _complete(vllm_openai, long)


def test_a_full_store_refuses_writes_counted_and_serving_goes_on(
        store_server: Server, redis_server: LocalRedis, vllm_openai: str) -> None:
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1mb")  # below what it holds: every write is refused
    try:
        before = _prefills(store_server)
        text = _complete(store_server.base_url, _prompt("F"))
        assert wait_until(lambda: _total(_prefills(store_server), "kv_store_put_failures")
                          > _total(before, "kv_store_put_failures"), timeout_s=20)
    finally:
        client.config_set("maxmemory", "512mb")
        client.config_set("maxmemory-policy", "allkeys-lru")
    assert text == _complete(vllm_openai, _prompt("F"))


def test_a_stopped_store_costs_a_deadline_and_the_text_is_one_engines(
        store_server: Server, redis_server: LocalRedis, vllm_openai: str) -> None:
    before = _prefills(store_server)
    redis_server.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        text = _complete(store_server.base_url, _prompt("S"))
        took = time.monotonic() - start
    finally:
        redis_server.send_signal(signal.SIGCONT)
    after = _prefills(store_server)
    assert _total(after, "kv_store_lookup_timeouts") > _total(before, "kv_store_lookup_timeouts")
    assert took < 60  # one 0.5 s deadline, then lookups pause: never a hang
    assert text == _complete(vllm_openai, _prompt("S"))


def test_a_new_weight_version_never_loads_the_old_versions_blocks(
        store_server: Server, one_prefill: dict[str, Any], vllm_openai: str) -> None:
    url = store_server.base_url
    time.sleep(2.5)  # past any pause a fault test left
    r = httpx.post(f"{store_server.admin_url}/update_weight_version",
                   json={"new_version": "v2"}, timeout=60)
    assert r.status_code == 200, r.text
    before = _prefills(store_server)
    text = _complete(url, _prompt("A"))  # its v1 blocks are in the store
    after = _prefills(store_server)
    assert _total(after, "kv_store_lookups") > _total(before, "kv_store_lookups")
    assert _total(after, "kv_store_hit_blocks") == _total(before, "kv_store_hit_blocks")
    assert text == one_prefill["oracle"]  # the same weights under a new name


def test_a_killed_store_is_a_counted_miss_and_serving_goes_on(
        store_server: Server, redis_server: LocalRedis, vllm_openai: str) -> None:
    time.sleep(2.5)  # past any pause an earlier test left
    before = _prefills(store_server)
    redis_server.stop(signal.SIGKILL)
    text = _complete(store_server.base_url, _prompt("K"))
    after = _prefills(store_server)
    assert _total(after, "kv_store_lookup_errors") > _total(before, "kv_store_lookup_errors")
    assert text == _complete(vllm_openai, _prompt("K"))
