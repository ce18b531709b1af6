"""``pdserve bench rollout-lora``'s pure parts on fakes: a response's cut choices and lost
tokens, its version spans, refits per minute, the config, both systems' command lines,
and the loop against a fake server that aborts what runs at ``/pause?mode=abort``."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.bench.compare.systems import EngineSettings
from pdserve.bench.micro.rollout.lora_client import LoraClient, take_chunk
from pdserve.bench.micro.rollout.lora_config import RolloutLoraConfig
from pdserve.bench.micro.rollout.lora_report import ModeResult, RefitTiming, Sample, ratio
from pdserve.bench.micro.rollout.lora_rounds import ModeRounds
from pdserve.bench.micro.rollout.lora_systems import (
    VLLM_LORA_ENV,
    LoraSettings,
    pdserve_lora,
    vllm_lora,
)


def _sample(kind: str = "load", n: int = 1, tokens: dict[int, int] | None = None,
            finish: dict[int, str | None] | None = None, **kw: Any) -> Sample:
    return Sample(kind=kind, started_s=0.0, ended_s=1.0, status=200, n=n,
                  tokens=tokens or {}, finish=finish or {}, **kw)


def test_cut_choices_are_aborted_or_unfinished_and_their_tokens_are_lost() -> None:
    s = _sample(n=3, tokens={0: 5, 1: 7, 2: 3}, finish={0: "stop", 1: "abort"})
    assert s.cut() == [1, 2] and s.lost_tokens == 10 and s.num_tokens == 15
    whole = _sample(n=2, tokens={0: 4, 1: 4}, finish={0: "length", 1: "stop"})
    assert whole.cut() == [] and whole.lost_tokens == 0
    # a choice never seen is cut (nothing lost, but it must be generated again)
    assert _sample(n=2, tokens={0: 4}, finish={0: "stop"}).cut() == [1]


def test_attributable_needs_spans_covering_every_token_of_every_choice() -> None:
    spans = [{"version": "a", "start": 0, "end": 3, "index": 0},
             {"version": "b", "start": 3, "end": 5, "index": 0},
             {"version": "a", "start": 0, "end": 2, "index": 1}]
    assert _sample(n=2, tokens={0: 5, 1: 2}, spans=spans).attributable()
    assert not _sample(n=2, tokens={0: 5, 1: 3}, spans=spans).attributable()  # short
    gap = [{"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 3, "end": 5}]
    assert not _sample(tokens={0: 5}, spans=gap).attributable()
    assert not _sample(tokens={0: 5}).attributable()  # vLLM: no spans


def test_a_switch_is_named_by_spans_of_two_adapter_folders() -> None:
    kept = [{"version": "v", "lora": "sql#aa", "start": 0, "end": 3},
            {"version": "v", "lora": "sql#bb", "start": 3, "end": 5}]
    assert _sample(tokens={0: 5}, spans=kept).names_switch()
    assert not _sample(tokens={0: 5}, spans=kept[:1]).names_switch()
    assert not _sample(tokens={0: 5}).names_switch()  # vLLM: no spans


def test_chunks_count_token_ids_finish_reasons_and_usage_spans() -> None:
    s = Sample(kind="batch", started_s=0.0, n=2)
    take_chunk(s, {"choices": [{"index": 0, "delta": {"content": "ab"}, "token_ids": [1, 2]}]},
               5.0)
    take_chunk(s, {"choices": [{"index": 1, "delta": {"content": "c"}}]}, 6.0)  # no ids
    take_chunk(s, {"choices": [{"index": 0, "delta": {}, "finish_reason": "abort"},
                               {"index": 1, "delta": {}, "finish_reason": "stop"}]}, 7.0)
    take_chunk(s, {"choices": [], "system_fingerprint": "v",
                   "usage": {"weight_versions": [{"version": "v", "start": 0, "end": 2}]}},
               8.0)
    assert s.tokens == {0: 2, 1: 1} and s.finish == {0: "abort", 1: "stop"}
    assert s.first_token_s == 5.0 and s.spans == [{"version": "v", "start": 0, "end": 2}]
    assert s.cut() == [0] and s.lost_tokens == 2 and s.fingerprints == {"v"}


def test_summary_refits_per_minute_and_tokens_per_refit() -> None:
    r = ModeResult("pdserve", "abort", wall_s=30.0)
    r.refits = [RefitTiming(10.0, 10.5, 11.0, 11.2, 11.6), RefitTiming(20, 20.1, 21, 21.4, 22)]
    r.samples = [_sample(tokens={0: 6}, finish={0: "abort"}),  # cut: 6 lost
                 _sample(kind="regen", tokens={0: 9}, finish={0: "length"}),
                 _sample(kind="batch", n=2, tokens={0: 4, 1: 4}, finish={0: "stop", 1: "stop"}),
                 Sample(kind="probe", started_s=0, status=503, error="busy")]
    s = r.summary()
    assert s["refits"] == 2 and s["refits_per_min"] == pytest.approx(4.0)
    assert s["refit_latency_s"] == pytest.approx((1.2 + 1.4) / 2)
    assert s["refit_to_token_s"] == pytest.approx((1.6 + 2.0) / 2)
    assert s["tokens_lost_per_refit"] == 3.0 and s["tokens_regenerated_per_refit"] == 4.5
    assert (s["requests"], s["requests_cut"], s["requests_failed"]) == (3, 1, 1)
    assert s["attributable"] == 0.0 and s["fingerprints"] == []
    assert ModeResult("vllm", "keep").summary()["refits_per_min"] is None
    assert ratio(2.0, 4.0) == 0.5 and ratio(1.0, 0) is None and ratio(None, 1.0) is None


@pytest.mark.parametrize("kwargs, match", [
    ({"modes": ("keep", "drain")}, "--modes"), ({"modes": ()}, "--modes"),
    ({"systems": ("vllm", "vllm")}, "--systems"), ({"systems": ("sglang",)}, "--systems"),
    ({"adapters": 1}, "--adapters"), ({"refits": 0}, "--refits"), ({"rank": 7}, "--rank"),
    ({"n": 2, "temperature": 0.0}, "--temperature"), ({"adapter_name": "a=b"}, "--adapter"),
    ({"pause_timeout_s": 0.0}, "--pause-timeout-s"), ({"load": -1}, "--load")])
def test_config_refuses_bad_values(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RolloutLoraConfig(**kwargs)


def test_the_cli_builds_the_config() -> None:
    from pdserve.cli import bench, bench_micro

    args = bench.build_parser().parse_args(["rollout-lora", "--modes", "abort,wait",
                                            "--systems", "vllm", "--refits", "2",
                                            "--no-clear-cache"])
    cfg = bench_micro.build_config("rollout-lora", args)
    assert (cfg.modes, cfg.systems, cfg.refits, cfg.clear_cache) == (
        ("abort", "wait"), ("vllm",), 2, False)
    assert bench.main(["rollout-lora", "--modes", "pause"]) == 2


SETTINGS = EngineSettings("/m/smol", "smol", "float32", 2, 1024, (0, 1))
LORA = LoraSettings("policy", Path("/a/adapter-0"), 1, 8)
LORA_FLAGS = ["--enable-lora", "--lora-modules", "policy=/a/adapter-0", "--max-loras", "1",
              "--max-lora-rank", "8"]


def test_vllm_gets_the_lora_flags_and_the_routes_the_loop_needs() -> None:
    system = vllm_lora(SETTINGS, LORA, 9000)
    (proc,) = system.spec.procs
    argv = list(proc.argv)
    assert argv[argv.index("--dtype") + 1] == "float32" and argv[-len(LORA_FLAGS):] == LORA_FLAGS
    assert proc.env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert {k: proc.env[k] for k in VLLM_LORA_ENV} == {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1"}
    assert system.admin_url == system.url == "http://127.0.0.1:9000"


def test_pdserve_up_gets_the_same_lora_flags_and_an_admin_port() -> None:
    system = pdserve_lora(SETTINGS, LORA, 9000, 9001, command=("pdserve",))
    (proc,) = system.spec.procs
    argv = list(proc.argv)
    assert argv[:2] == ["pdserve", "up"] and argv[argv.index("--dtype") + 1] == "float32"
    assert argv[argv.index("--admin-port") + 1] == "9001" and argv[-len(LORA_FLAGS):] == LORA_FLAGS
    assert system.admin_url == "http://127.0.0.1:9001" and system.url.endswith(":9000")


# ---- the loop against a fake server ----------------------------------------------------

class FakeLoraServer:
    """vLLM's contract, small: ``/pause?mode=abort`` ends what streams (finish_reason
    abort), requests wait while paused, a load switches the adapter's folder."""

    def __init__(self, fail_load: bool = False, cut_all: bool = False) -> None:
        self.fail_load, self.cut_all, self.paused, self.epoch = fail_load, cut_all, False, 0
        self.calls: list[str] = []
        self.loads: list[str] = []
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self.chat)
        self.app.post("/pause")(self.pause)
        self.app.post("/resume")(self.resume)
        self.app.post("/v1/load_lora_adapter")(self.load)

    async def pause(self, mode: str) -> dict[str, str]:
        self.calls.append(f"pause:{mode}")
        self.paused = True
        if mode == "abort":
            self.epoch += 1
        return {"status": "paused"}

    async def resume(self) -> dict[str, str]:
        self.calls.append("resume")
        self.paused = False
        return {"status": "resumed"}

    async def load(self, request: Request) -> Any:
        body = await request.json()
        self.calls.append("load")
        if self.fail_load:
            return JSONResponse({"error": "no such folder"}, 400)
        self.loads.append(body["lora_path"])
        return JSONResponse("Success")

    async def chat(self, request: Request) -> Any:
        body = await request.json()
        while self.paused:
            await asyncio.sleep(0.005)
        return StreamingResponse(self._chunks(body["n"], body["max_tokens"], self.epoch),
                                 media_type="text/event-stream")

    async def _chunks(self, n: int, tokens: int, epoch: int) -> AsyncIterator[str]:
        for _ in range(tokens):
            await asyncio.sleep(0.004)
            if self.epoch != epoch or self.cut_all:  # aborted
                done = [{"index": i, "delta": {}, "finish_reason": "abort"} for i in range(n)]
                yield f"data: {json.dumps({'choices': done})}\n\n"
                return
            chunk = {"choices": [{"index": i, "delta": {"content": "x"}, "token_ids": [7]}
                                 for i in range(n)]}
            yield f"data: {json.dumps(chunk)}\n\n"
        done = [{"index": i, "delta": {}, "finish_reason": "length"} for i in range(n)]
        yield f"data: {json.dumps({'choices': done})}\n\n"
        yield "data: [DONE]\n\n"


async def _run(server: FakeLoraServer, mode: str, **kw: Any) -> ModeResult:
    cfg = RolloutLoraConfig(**{"refits": 3, "batch": 2, "n": 2, "max_tokens": 4, "load": 2,
                               "load_max_tokens": 40, **kw})
    prompts = [[{"role": "user", "content": f"p{i}"}] for i in range(8)]
    adapters = [Path("/a/0"), Path("/a/1")]
    async with LoraClient("http://api", "http://admin", "policy", 5.0,
                          transport=httpx.ASGITransport(app=server.app)) as client:
        return await ModeRounds(cfg, client, prompts, adapters, ModeResult("fake", mode),
                                1).run()


async def test_abort_cuts_the_load_and_the_loop_regenerates_it() -> None:
    server = FakeLoraServer()
    result = await _run(server, "abort")
    s = result.summary()
    assert result.error == "" and s["refits"] == 3 and s["requests_failed"] == 0
    assert server.loads == ["/a/1", "/a/0", "/a/1"]
    assert server.calls[:3] == ["pause:abort", "load", "resume"]
    assert s["requests_cut"] >= 1 and s["tokens_lost_per_refit"] > 0
    assert s["tokens_regenerated_per_refit"] > 0 and s["refits_per_min"] > 0
    assert all(not math.isnan(r.probe_first_s) and r.to_token_s >= r.latency_s > 0
               for r in result.refits)


async def test_wait_cuts_nothing() -> None:
    s = (await _run(FakeLoraServer(), "wait")).summary()
    assert (s["refits"], s["requests_cut"], s["tokens_lost_per_refit"]) == (3, 0, 0.0)


async def test_a_refused_load_ends_the_mode_resumed_and_with_its_error() -> None:
    server = FakeLoraServer(fail_load=True)
    result = await _run(server, "keep")
    assert "HTTP 400" in result.error and result.refits == []
    assert server.calls == ["pause:keep", "load", "resume"] and not server.paused
    await asyncio.sleep(0.01)
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_a_request_cut_more_often_than_there_are_refits_fails_the_mode() -> None:
    result = await _run(FakeLoraServer(cut_all=True), "wait", load=0)
    assert "cut 4 times: more than one cut per refit" in result.error
    assert result.refits == [] and result.summary()["requests_cut"] >= 4
    await asyncio.sleep(0.01)  # the batch's other request was cancelled, not left running
    assert asyncio.all_tasks() == {asyncio.current_task()}
