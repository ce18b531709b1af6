"""pdserve bench rollout without vLLM: the window accounting and version checks as pure
functions, and the whole loop against a fake router (FastAPI through httpx's ASGI
transport: no sockets) that serves the weight-update contract, or breaks it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.bench.micro.configs import RolloutConfig
from pdserve.bench.micro.rollout.client import RolloutClient
from pdserve.bench.micro.rollout.loop import Checkpoints, Rounds
from pdserve.bench.micro.rollout.report import (
    RefitSpan,
    RolloutCheckError,
    StreamRecord,
    Timeline,
    check_load,
    check_stream,
    expected_versions,
    summarize,
    window_rates,
)
from pdserve.bench.models.checkpoints import DEFAULT_SCALE

SPAN = RefitSpan(call_s=10.0, returned_s=11.0, first_token_s=11.5)


def _record(started: float, ended: float, version: str, header: str | None = None,
            status: int = 200) -> StreamRecord:
    return StreamRecord(started, status, header or version, {version}, [(ended, 3)], ended)


# ---- pure parts ----------------------------------------------------------------------

def test_window_rates_count_whole_windows_only() -> None:
    events = [(0.1, 2), (0.4, 1), (0.6, 4), (1.2, 5), (1.6, 9)]
    assert window_rates(events, 0.0, 1.7, 0.5) == [6.0, 8.0, 10.0]  # 1.5-1.7 left out


def test_timeline_phases_and_dip() -> None:
    # load from 8.0 s to 13.0 s; full rate 20 tok/s, nothing during the switch
    events = [(8.0 + i * 0.05, 1) for i in range(40)]  # 8.0-10.0: before
    events += [(10.6, 1)]  # during: one token
    events += [(11.5 + i * 0.05, 1) for i in range(30)]  # 11.5-13.0: after
    timeline = Timeline.of([StreamRecord(8.0, events=events)], 8.0, 13.0, 0.5, SPAN)
    assert timeline.start_s == -2.0
    assert timeline.phases == ("before",) * 4 + ("during",) * 3 + ("after",) * 3
    summary = timeline.summary()
    assert summary["before_tok_s"] == pytest.approx(20.0)
    assert summary["after_tok_s"] == pytest.approx(20.0)
    assert summary["during_min_tok_s"] == 0.0
    assert summary["dip"] == pytest.approx(1.0)
    assert summary["longest_stall_s"] == pytest.approx(0.5)  # 10.0-10.5, 11.0-11.5


def test_a_window_that_overlaps_the_call_is_during() -> None:
    assert Timeline.of([], 9.5, 12.0, 0.5, SPAN).phases == (
        "before", "during", "during", "during", "after")
    assert Timeline.of([], 9.75, 12.25, 0.5, SPAN).phases == ("during",) * 4 + ("after",)


def test_which_versions_a_stream_may_carry() -> None:
    assert expected_versions(_record(8.0, 9.9, "a"), SPAN, "a", "b") == ("a",)
    assert expected_versions(_record(11.0, 12.0, "b"), SPAN, "a", "b") == ("b",)
    assert expected_versions(_record(9.0, 11.2, "a"), SPAN, "a", "b") == ("a", "b")


def test_check_load_counts_versions_and_refuses_lies() -> None:
    records = [_record(8.0, 9.0, "a"), _record(9.5, 10.5, "a"), _record(10.5, 11.8, "b"),
               _record(11.2, 12.0, "b")]
    assert check_load(records, SPAN, "a", "b") == {"a": 2, "b": 2}
    with pytest.raises(RolloutCheckError, match="expected 'b'"):
        check_load([_record(11.2, 12.0, "a")], SPAN, "a", "b")  # began after the return
    with pytest.raises(RolloutCheckError, match="expected 'a'"):
        check_load([_record(8.0, 9.0, "b")], SPAN, "a", "b")  # ended before the call


def test_check_stream_refuses_mixed_mismatched_and_failed() -> None:
    mixed = _record(9.0, 11.0, "a")
    mixed.chunk_versions.add("b")
    with pytest.raises(RolloutCheckError, match="one expected"):
        check_stream(mixed, ("a", "b"))
    with pytest.raises(RolloutCheckError, match="x-weight-version"):
        check_stream(_record(9.0, 11.0, "a", header="b"), ("a", "b"))
    with pytest.raises(RolloutCheckError, match="HTTP 503"):
        check_stream(_record(9.0, 11.0, "a", status=503), ("a",))


def test_config_refuses_bad_flags_and_matches_the_checkpoint_scale() -> None:
    assert RolloutConfig().scale == DEFAULT_SCALE
    for bad in ({"policy": "pause"}, {"url": "http://x"}, {"n": 0}, {"load": -1},
                {"window_s": 0}, {"before_s": 0.1, "window_s": 0.5},
                {"n": 2, "temperature": 0.0}):
        with pytest.raises(ValueError):
            RolloutConfig(**bad)


# ---- the loop against a fake router ----------------------------------------------------

class FakeRouter:
    """The contract's router: a version, updates that switch it, every response stamped.
    ``stale``: updates answer success but responses keep the old version."""

    def __init__(self, stale: bool = False, fail_update: bool = False) -> None:
        self.version, self.stale, self.fail_update = "v0", stale, fail_update
        self.served = "v0"
        self.updates: list[dict[str, Any]] = []
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/chat/completions")(self.chat)
        self.app.get("/weight_info")(self.info)
        self.app.post("/update_weights_from_disk")(self.update)

    async def models(self) -> dict[str, Any]:
        return {"data": [{"id": "fake"}]}

    async def info(self) -> dict[str, Any]:
        return {"weight_version": self.version, "workers": {"p0": self.version,
                                                            "d0": self.version}}

    async def update(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.updates.append(body)
        await asyncio.sleep(0.02)
        if self.fail_update:
            return JSONResponse({"success": False, "message": "stage failed on d0"}, 500)
        self.version = body["weight_version"]
        self.served = self.served if self.stale else self.version
        return JSONResponse({"success": True, "message": "", "weight_version": self.version,
                             "seconds": 0.02, "stage_seconds": 0.01,
                             "workers": {"p0": self.version,
                                                          "d0": self.version}})

    async def chat(self, request: Request) -> Any:
        body = await request.json()
        version, headers = self.served, {"x-weight-version": self.served}
        if not body.get("stream"):
            n, tokens = body.get("n", 1), body["max_tokens"]
            return JSONResponse({"system_fingerprint": version,
                                 "choices": [{"index": i} for i in range(n)],
                                 "usage": {"completion_tokens": n * tokens}}, headers=headers)
        return StreamingResponse(self._chunks(version, body["max_tokens"]),
                                 media_type="text/event-stream", headers=headers)

    async def _chunks(self, version: str, tokens: int) -> AsyncIterator[str]:
        for _ in range(tokens):
            await asyncio.sleep(0.002)
            chunk = {"system_fingerprint": version,
                     "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [7]}]}
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"


def _cfg(**kwargs: Any) -> RolloutConfig:
    base: dict[str, Any] = {"url": "http://router", "admin_url": "http://admin", "rounds": 3,
                            "batch": 2, "n": 2, "max_tokens": 5, "load": 2,
                            "load_max_tokens": 8, "window_s": 0.05, "before_s": 0.1}
    return RolloutConfig(**{**base, **kwargs})


async def _rounds(router: FakeRouter, cfg: RolloutConfig) -> tuple[str, list[Any]]:
    transport = httpx.ASGITransport(app=router.app)
    prompts = [[{"role": "user", "content": f"p{i}"}] for i in range(6)]
    async with RolloutClient("http://router", "http://admin", None, None, 5.0,
                             transport=transport) as client:
        return await Rounds(cfg, client, prompts,
                            Checkpoints(Path("/ck/orig"), Path("/ck/pert"))).run()


async def test_the_loop_alternates_checkpoints_and_reports_each_round() -> None:
    router = FakeRouter()
    # 0.5 s of load before each call: windows count once the load is warm, which on a
    # loaded machine takes longer than the default 0.1 s here (then no window is "before")
    final, rounds = await _rounds(router, _cfg(before_s=0.5))
    assert final == "r3"
    assert [u["model_path"] for u in router.updates] == ["/ck/pert", "/ck/orig", "/ck/pert"]
    assert [u["weight_version"] for u in router.updates] == ["r1", "r2", "r3"]
    assert [(r.batch_version, r.version) for r in rounds] == [("v0", "r1"), ("r1", "r2"),
                                                               ("r2", "r3")]
    for r in rounds:
        assert r.batch_samples == 4 and r.batch_tokens == 20
        assert r.refit_e2e_s >= r.refit_call_s > 0 and r.refit_stage_s == 0.01
        assert sum(r.load_versions.values()) > 0
        assert r.timeline is not None and "before" in r.timeline.phases
        assert r.to_json()["timeline_summary"]["before_tok_s"] > 0
    refit_e2e_s_median = summarize(rounds)["refit_e2e_s_median"]
    assert refit_e2e_s_median is not None and refit_e2e_s_median > 0


async def test_no_load_means_no_timeline() -> None:
    _, rounds = await _rounds(FakeRouter(), _cfg(load=0, rounds=1))
    assert rounds[0].timeline is None and rounds[0].load_versions == {}


async def test_a_version_that_did_not_change_fails_the_run() -> None:
    with pytest.raises(RolloutCheckError, match="expected 'r1'"):
        await _rounds(FakeRouter(stale=True), _cfg(load=0))


@pytest.mark.parametrize("load", [0, 2])
async def test_a_failed_update_fails_the_run_and_leaves_no_stream(load: int) -> None:
    with pytest.raises(RolloutCheckError, match="HTTP 500"):
        await _rounds(FakeRouter(fail_update=True), _cfg(load=load))
    await asyncio.sleep(0.01)  # the cancelled streams' last step
    assert asyncio.all_tasks() == {asyncio.current_task()}


def test_the_cli_builds_its_config_and_refuses_a_url_without_admin(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.cli import bench, bench_micro

    args = bench.build_parser().parse_args(["rollout", "--rounds", "2", "--batch", "4",
                                            "--n", "2", "--max-tokens", "32"])
    cfg = bench_micro.build_config("rollout", args)
    assert (cfg.rounds, cfg.batch, cfg.n, cfg.max_tokens, cfg.url) == (2, 4, 2, 32, None)
    assert bench.main(["rollout", "--url", "http://127.0.0.1:1"]) == 2
    assert "--admin-url" in capsys.readouterr().err
