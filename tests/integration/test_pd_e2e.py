"""P/D end to end on real vLLM engines: the official openai client against
``pdserve up --dtype float32 --disagg auto`` (KV over tcp, pushed), checked against one
aggregated vLLM; which requests were disaggregated; then the engines' KV counters, bad
input and client disconnects. The same
equality over the other transports is in ``test_pd_e2e_transports.py``."""

from __future__ import annotations

import statistics
import time
from typing import Any

import httpx
import openai
import pytest
from integration.pd_cases import (
    BLOCK_SIZE,
    CASES,
    LOCAL_PREFILL_MAX_TOKENS,
    LONG,
    MODEL,
    NUM_LAYERS,
    post_case,
    prompt_ids,
    run_case,
)
from pdserve_testing import Server, read_events, router_metric, stream_timed, wait_until

from pdserve.core.types import WorkerLoadReport

pytestmark = pytest.mark.integration


def prompt_counters(server: Server) -> tuple[int, int, int]:
    load = server.load("decode")
    return (load.prompt_tokens_computed, load.prompt_tokens_local_cache_hit,
            load.prompt_tokens_external)


def test_greedy_pd_equals_aggregated_vllm_and_kv_came_over_the_transport(
    pd_server: Server, tokenizer: Any, reference: list[list[int]]
) -> None:
    client = openai.OpenAI(base_url=pd_server.base_url, api_key="none", timeout=120)
    assert max(len(prompt_ids(tokenizer, c)) for c in CASES) > 500
    assert {(c.kind, c.stream) for c in CASES} == {(k, s) for k in ("chat", "completion")
                                                    for s in (True, False)}
    for case, want in zip(CASES, reference, strict=True):
        num_prompt = len(prompt_ids(tokenizer, case))
        before = prompt_counters(pd_server)
        text, ids = run_case(client, case)
        assert ids == want, f"{case.kind} stream={case.stream}: P/D diverged from vLLM"
        assert text == tokenizer.decode(want, skip_special_tokens=True)
        if len(want) < 2 or num_prompt <= LOCAL_PREFILL_MAX_TOKENS:
            continue  # finished in prefill, or run on decode alone (--disagg auto)
        # Decode saw prompt + [first token]; the engine's own counters say where each came from.
        def counted(b: tuple[int, int, int] = before, n: int = num_prompt
                    ) -> tuple[int, int, int] | None:
            a = prompt_counters(pd_server)
            return a if sum(a) - sum(b) >= n + 1 else None

        after = wait_until(counted, timeout_s=30)
        assert after is not None, "decode's engine counters never saw the request"
        computed, local_hit, external = (a - b for a, b in zip(after, before, strict=True))
        assert computed + local_hit + external == num_prompt + 1
        assert computed <= BLOCK_SIZE, f"decode computed {computed} prompt tokens itself"
        assert external >= num_prompt - local_hit, "the prompt's KV did not come over the wire"


_LOCAL = ("pdserve:disagg_decisions_total", 'decision="local"', 'reason="short_prompt"')
_REMOTE = ("pdserve:disagg_decisions_total", 'decision="remote"', 'reason="long_prompt"')


def decode_saw(server: Server, before: tuple[int, int, int], num_tokens: int
               ) -> tuple[int, int, int]:
    """Decode's prompt counters grown by ``num_tokens`` since ``before``, as deltas."""
    def counted() -> tuple[int, int, int] | None:
        a = prompt_counters(server)
        return a if sum(a) - sum(before) >= num_tokens else None

    after = wait_until(counted, timeout_s=30)
    assert after is not None, "decode's engine counters never saw the request"
    computed, local_hit, external = (a - b for a, b in zip(after, before, strict=True))
    return computed, local_hit, external


def test_auto_disagg_short_local_long_remote(
    pd_server: Server, tokenizer: Any, reference: list[list[int]]
) -> None:
    """``--disagg auto``: CASES' short prompts run on decode alone, the two long ones go
    prefill → decode; the answers are vLLM's either way, and the header, the usage, the
    decode engine's counters and the router's metrics agree on the path each took."""
    lengths = [len(prompt_ids(tokenizer, c)) for c in CASES]
    num_local = sum(n <= LOCAL_PREFILL_MAX_TOKENS for n in lengths)
    assert 0 < num_local < len(CASES) and max(lengths) > 2 * LOCAL_PREFILL_MAX_TOKENS
    local0, remote0 = pd_server.metric(*_LOCAL), pd_server.metric(*_REMOTE)
    for case, want, num_prompt in zip(CASES, reference, lengths, strict=True):
        local = num_prompt <= LOCAL_PREFILL_MAX_TOKENS
        before = prompt_counters(pd_server)
        reply = post_case(pd_server.base_url, case)
        assert reply.token_ids == want, f"{case.kind} stream={case.stream}: diverged"
        assert reply.disagg == ("local; reason=short_prompt" if local
                                else "remote; reason=long_prompt")
        assert reply.usage["pdserve_disagg"] == ("local" if local else "remote")
        if local:  # decode computed the prompt (or hit its own cache); nothing came in
            computed, local_hit, external = decode_saw(pd_server, before, num_prompt)
            assert computed > 0 and computed + local_hit == num_prompt and external == 0
        elif len(want) >= 2:  # decode saw prompt + t1, the prompt's KV from prefill
            computed, local_hit, external = decode_saw(pd_server, before, num_prompt + 1)
            assert external > 0 and computed <= BLOCK_SIZE
    assert pd_server.metric(*_LOCAL) - local0 == num_local
    assert pd_server.metric(*_REMOTE) - remote0 == len(CASES) - num_local


def test_prefill_holds_no_blocks_and_no_transfer_is_pending_after_requests(
    pd_server: Server,
) -> None:
    client = openai.OpenAI(base_url=pd_server.base_url, api_key="none", timeout=120)

    def settled() -> bool:
        p, d = pd_server.load("prefill"), pd_server.load("decode")
        return (p.num_pending_transfers == 0 and d.num_pending_transfers == 0
                and p.kv_cache_usage == 0.0 and d.kv_cache_usage == 0.0
                and p.num_inflight_reqs == 0 and d.num_inflight_reqs == 0)

    # Counters are cumulative over the session: compare before and after these requests
    # (taken once earlier tests' requests have settled).
    assert wait_until(settled, timeout_s=15)
    p0, d0 = pd_server.load("prefill"), pd_server.load("decode")
    for i in range(3):
        client.completions.create(model=MODEL, prompt=f"{i}: " + LONG, max_tokens=4,
                                  temperature=0)
    assert wait_until(settled, timeout_s=15)
    prefill, decode = pd_server.load("prefill"), pd_server.load("decode")
    assert decode.kv_loads - d0.kv_loads >= 3
    assert prefill.kv_leases_expired == p0.kv_leases_expired
    # Every load ended the prefill's lease: pulled, or taken from the push inbox.
    assert (prefill.kv_transfers_completed - p0.kv_transfers_completed
            + decode.kv_push_loads - d0.kv_push_loads) >= 3


def test_prefill_pushes_layer_by_layer_and_decode_takes_the_push(pd_server: Server) -> None:
    """The default (tcp, --kv-push): KV moves while prefill computes; nothing is pulled."""
    client = openai.OpenAI(base_url=pd_server.base_url, api_key="none", timeout=120)
    p0, d0 = pd_server.load("prefill"), pd_server.load("decode")
    client.completions.create(model=MODEL, prompt="push: " + LONG, max_tokens=3, temperature=0)

    def loaded() -> tuple[WorkerLoadReport, WorkerLoadReport] | None:
        p, d = pd_server.load("prefill"), pd_server.load("decode")
        return (p, d) if d.kv_loads > d0.kv_loads and p.num_pending_transfers == 0 else None

    settled = wait_until(loaded, timeout_s=15)
    assert settled is not None
    _, d = settled

    # The prefill counts a layer once the decode's ack reaches it: the decode may have
    # taken the push, and ended the lease, before the last ack was counted.
    def pushed() -> WorkerLoadReport | None:
        p = pd_server.load("prefill")
        return p if p.kv_layers_pushed - p0.kv_layers_pushed >= NUM_LAYERS else None

    p = wait_until(pushed, timeout_s=15)
    assert p is not None, "the prefill never counted every layer pushed"  # at least once
    assert p.kv_pushes_failed == p0.kv_pushes_failed
    assert d.kv_push_loads - d0.kv_push_loads == 1
    assert d.kv_push_fallbacks == d0.kv_push_fallbacks
    assert p.kv_transfers_completed == p0.kv_transfers_completed, "decode pulled instead"
    assert d.kv_bytes_received - d0.kv_bytes_received > 0


BAD_INPUTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model_not_found"),
    ("/v1/completions", {"model": MODEL}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2, "temperature": 0}, 400,
     None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": LONG * 12, "max_tokens": 8}, 400,
     "context_length_exceeded"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 5000}, 400, "context_length_exceeded"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "stream_options": {"include_usage": True}}, 400, None),
]


@pytest.mark.parametrize(("path", "body", "status", "code"), BAD_INPUTS)
def test_bad_input_gets_openai_error_and_server_keeps_serving(
    pd_server: Server, path: str, body: Any, status: int, code: str | None
) -> None:
    url = pd_server.base_url.removesuffix("/v1") + path
    if isinstance(body, bytes):
        resp = httpx.post(url, content=body, headers={"content-type": "application/json"},
                          timeout=30)
    else:
        resp = httpx.post(url, json=body, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    ok = httpx.post(pd_server.base_url + "/completions", timeout=60,
                    json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200


def generated_on_decode(server: Server) -> float:
    """The decode engine's own count of tokens it generated (vllm:generation_tokens)."""
    url = server.metrics_targets["decode-0"]
    return router_metric(url.removesuffix("/metrics"), "vllm:generation_tokens_total")


def test_client_disconnect_mid_stream_aborts_on_both_workers(pd_server: Server) -> None:
    body = {"model": MODEL, "prompt": "Count: " + LONG, "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    generated = generated_on_decode(pd_server)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", pd_server.base_url + "/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # held: a dropped iterator closes the response
            read_events(lines, 3)
            assert pd_server.load("decode").num_inflight_reqs == 1
    assert wait_until(pd_server.idle, timeout_s=60), "request still running after the client left"
    # Aborted, not finished: the engine stopped far short of the 1000 tokens, however
    # fast this machine generates them.
    assert generated_on_decode(pd_server) - generated < 500


def deadline_mid_decode(server: Server, body: dict[str, Any]) -> float:
    """A deadline for ``body`` that lands after its first token and long before its
    last, from this cluster's own times: the same request streamed (its prompt now in
    the prefix caches, so the next one's first token comes no later) until 8 tokens,
    then dropped."""
    probe = stream_timed(server.base_url, {**body, "stream": True}, stop_after=8)
    assert wait_until(server.idle, timeout_s=15)
    return 2 * probe.ttft_s + 8 * max(statistics.median(probe.gaps_s), 0.05)


@pytest.mark.parametrize("stream", [False, True])
def test_request_past_its_deadline_gets_504_and_no_worker_holds_it(
    pd_server: Server, stream: bool
) -> None:
    """``X-Request-Timeout`` shorter than the request: 504 before any token, or an SSE
    error event then ``[DONE]`` once streaming started; both workers then hold nothing.
    Streaming, the deadline lands mid-decode wherever this machine puts it."""
    assert wait_until(pd_server.idle, timeout_s=15)
    body = {"model": MODEL, "prompt": "Count: " + LONG, "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": stream, "return_token_ids": True}
    timeout_s = deadline_mid_decode(pd_server, body) if stream else 0.3
    headers = {"X-Request-Timeout": f"{timeout_s:.3f}"}
    started = time.monotonic()
    with httpx.Client(timeout=60) as http:
        if not stream:  # the whole answer is due at once: 1000 tokens never fit
            reply = http.post(pd_server.base_url + "/completions", json=body, headers=headers)
            assert reply.status_code == 504, reply.text
            assert reply.json()["error"]["code"] == "timeout"
        else:
            with http.stream("POST", pd_server.base_url + "/completions", json=body,
                             headers=headers) as resp:
                assert resp.status_code == 200
                events = [line.removeprefix("data: ") for line in resp.iter_lines()
                          if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and '"error"' in events[-2], events[-3:]
            assert any('"text"' in e for e in events[:-2])  # tokens came before the error
    assert time.monotonic() - started < timeout_s + 5  # ended at the deadline, not at 1000
    assert wait_until(pd_server.idle, timeout_s=10), "a worker still holds it"


@pytest.mark.parametrize("prompt", ["Tell me a story.", LONG], ids=["local", "remote"])
def test_a_lone_stream_never_stalls(pd_server: Server, prompt: str) -> None:
    """A lone 64-token stream on an idle cluster, prefilled on decode (short prompt) or
    handed off (long): no gap between two tokens reaches 1 s. A second is not a slow
    machine (a step here is tens of ms): it is a lost wake-up, such as vLLM's
    shared-memory queue missing a ping and sleeping to its 5 s recheck."""
    assert wait_until(pd_server.idle, timeout_s=15)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    for _ in range(2):  # the second: the prompt cached, the path otherwise the same
        timed = stream_timed(pd_server.base_url, body)
        assert timed.num_tokens == 64
        worst = max(timed.gaps_s)
        assert worst < 1.0, (f"a {worst:.2f} s gap between two tokens "
                             f"(gaps {[round(g, 2) for g in timed.gaps_s]})")
