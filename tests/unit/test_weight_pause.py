"""vLLM's pause semantics through the router, on simulated workers over real gRPC:
``keep`` freezes what runs and resumes it on the weights after (its chunks say where
the version changed), ``wait`` honours its timeout, ``/resume`` is refused while a
commit runs, ``finish_weight_update`` without a version still names new weights."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from unit.fakes import ROUTER_MODEL, asgi_http_client, chat_body, cmpl_body, sse_payloads
from unit.test_weight_updates import MAX_TOKENS, PROMPT, bench, tokens

from pdserve.core.types import SamplingSpec, WeightsCommitted
from pdserve.core.weight_calls import FinishWeightUpdate
from pdserve.router.cluster.errors import ClusterError
from pdserve.router.cluster.weight_updates import DiskUpdate
from pdserve.router.dispatch.base import TokenChunk
from pdserve.router.http.app import create_app
from pdserve.router.http.errors import to_api_error


def versions(chunks: list[TokenChunk]) -> list[tuple[str, int]]:
    """Each version the chunks name, and how many tokens it produced (in order)."""
    spans: list[tuple[str, int]] = []
    for chunk in chunks:
        version = chunk.weight_version or spans[-1][0]
        if not spans or spans[-1][0] != version:
            spans.append((version, 0))
        spans[-1] = (version, spans[-1][1] + len(chunk.token_ids))
    return spans


async def test_a_keep_refit_resumes_a_stream_on_the_new_weights_and_says_where(
        tmp_path: Path) -> None:
    async with bench(tmp_path) as b:
        running = asyncio.create_task(b.run("r0"))
        await asyncio.sleep(0.15)  # decoding now
        await b.updater.update_from_disk(DiskUpdate(
            model_path=str(tmp_path), weight_version="v2", policy="keep"))
        chunks = await running
        spans = versions(chunks)
        assert [v for v, _ in spans] == ["default", "v2"], spans
        assert chunks[-1].finish_reason == "length" and len(tokens(chunks)) == MAX_TOKENS
        kept = spans[0][1]
        assert 0 < kept < MAX_TOKENS
        # The rest is what the new weights give after the prompt and the kept tokens.
        head = tokens(chunks)[:kept]
        rest = [t async for c in b.sims.dispatcher.generate(
            "ref", (*PROMPT, *head), SamplingSpec(max_tokens=MAX_TOKENS - kept,
                                                  temperature=0.0)) for t in c.token_ids]
        assert tokens(chunks)[kept:] == rest


async def test_pause_keep_freezes_until_resume(tmp_path: Path) -> None:
    async with bench(tmp_path) as b:
        running = asyncio.create_task(b.run("r0"))
        await asyncio.sleep(0.15)
        await b.updater.pause("keep")
        await asyncio.sleep(0.3)
        assert not running.done() and b.updater.paused
        b.updater.resume()
        chunks = await asyncio.wait_for(running, 10)
        assert chunks[-1].finish_reason == "length" and len(tokens(chunks)) == MAX_TOKENS
        assert [v for v, _ in versions(chunks)] == ["default"]  # same weights after


async def test_pause_wait_honours_its_timeout(tmp_path: Path) -> None:
    async with bench(tmp_path) as b:
        running = asyncio.create_task(b.run("r0"))  # 40 tokens of 10 ms
        await asyncio.sleep(0.1)
        started = time.monotonic()
        ended = await b.updater.pause("wait", clear_cache=False, timeout_s=0.05)
        assert time.monotonic() - started < 2.0 and ended == 1
        chunks = await asyncio.wait_for(running, 5)
        assert chunks[-1].finish_reason == "abort" and len(tokens(chunks)) < MAX_TOKENS
        b.updater.resume()


async def test_resume_is_refused_while_a_commit_runs(tmp_path: Path) -> None:
    async with bench(tmp_path) as b:
        assert b.sims.pool is not None
        decode = b.sims.pool.decode[0]
        commit, entered, release = decode.client.commit_weights, asyncio.Event(), \
            asyncio.Event()

        async def slow_commit(*args: Any, **kwargs: Any) -> WeightsCommitted:
            entered.set()
            await release.wait()
            return await commit(*args, **kwargs)

        decode.client.commit_weights = slow_commit  # type: ignore[method-assign]
        update = asyncio.create_task(b.updater.update_from_disk(DiskUpdate(
            model_path=str(tmp_path), weight_version="v2")))
        await asyncio.wait_for(entered.wait(), 5)
        with pytest.raises(ClusterError) as refused:
            b.updater.resume()
        assert to_api_error(refused.value).status_code == 409
        assert b.updater.paused  # still closed
        release.set()
        await update
        assert not b.updater.paused and (await b.run("r1"))[0].weight_version == "v2"


async def test_finish_weight_update_without_a_version_names_new_weights(
        tmp_path: Path) -> None:
    async with bench(tmp_path) as b:
        await b.updater.engine_call(FinishWeightUpdate(None))
        (version,) = b.versions()
        assert version.startswith("default@")  # a new salt: no old KV matches
        assert (await b.run("r0"))[0].weight_version == version


@pytest.mark.parametrize(("endpoint", "stream"), [
    ("completions", False), ("completions", True), ("chat/completions", False),
    ("chat/completions", True)])
async def test_usage_names_the_version_of_each_span_of_tokens(
        tmp_path: Path, tokenizer: Any, endpoint: str, stream: bool) -> None:
    """A request that crosses a ``keep`` refit reports two spans, where it switched;
    every other response one, covering all its tokens."""
    body: dict[str, Any] = {"max_tokens": MAX_TOKENS, "stream": stream, "ignore_eos": True,
                            "return_token_ids": True, "temperature": 0}
    if stream:
        body["stream_options"] = {"include_usage": True}
    body |= cmpl_body() if endpoint == "completions" else chat_body()
    async with bench(tmp_path) as b:
        app = create_app(served_model_name=ROUTER_MODEL, max_model_len=4096,
                         tokenizer=tokenizer, dispatcher=b.sims.dispatcher,
                         registry=b.sims.registry)
        async with asgi_http_client(app) as http:
            plain = await http.post(f"/v1/{endpoint}", json={
                **body, "stream": False, "stream_options": None})
            assert plain.status_code == 200, plain.text
            assert plain.json()["usage"]["weight_versions"] == [
                {"version": "default", "start": 0, "end": MAX_TOKENS}]
            call = asyncio.create_task(http.post(f"/v1/{endpoint}", json=body))
            await asyncio.sleep(0.15)
            await b.updater.update_from_disk(DiskUpdate(
                model_path=str(tmp_path), weight_version="v2", policy="keep"))
            resp = await asyncio.wait_for(call, 10)
            assert resp.status_code == 200, resp.text
            if stream:
                events = sse_payloads(resp.text)[:-1]
                usage, prompt = events[-1]["usage"], events[0]["prompt_token_ids"]
                ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
            else:
                usage, prompt = resp.json()["usage"], resp.json()["prompt_token_ids"]
                ids = resp.json()["choices"][0]["token_ids"]
            first, second = usage["weight_versions"]
            assert first["version"] == "default" and second["version"] == "v2", usage
            assert first["start"] == 0 and first["end"] == second["start"] > 0
            assert second["end"] == usage["completion_tokens"] == len(ids) == MAX_TOKENS
            kept = int(first["end"])
            assert ids[:kept] == plain.json()["choices"][0]["token_ids"][:kept]
            rest = [t async for c in b.sims.dispatcher.generate(  # the new weights after them
                "ref", (*prompt, *ids[:kept]), SamplingSpec(
                    max_tokens=MAX_TOKENS - kept, temperature=0.0, ignore_eos=True))
                for t in c.token_ids]
            assert ids[kept:] == rest
