"""``pdserve bench``'s worker counters: every worker's /metrics, summed per role, and
what a run added (the KV MiB decode loaded per request)."""

from __future__ import annotations

import httpx

from pdserve.bench.compare.worker_counters import counters_delta, read_counters

WORKERS = {"workers": [
    {"role": "prefill", "metrics_endpoint": "p0:9100"},
    {"role": "decode", "metrics_endpoint": "d0:9101"},
    {"role": "decode", "metrics_endpoint": "d1:9102"},
    {"role": "decode", "metrics_endpoint": ""},  # no /metrics: counts nothing
]}


def metrics(received: float, prompt: float) -> str:
    return ("# TYPE pdserve:kv_transfer_bytes_received counter\n"
            f"pdserve:kv_transfer_bytes_received_total {received}\n"
            "# TYPE vllm:prompt_tokens counter\n"
            f'vllm:prompt_tokens_total{{model_name="m",engine="0"}} {prompt}\n'
            "# TYPE other counter\nother_total 99\n")


def transport(scale: float) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/workers":
            return httpx.Response(200, json=WORKERS)
        host = request.url.host
        if host == "p0":
            return httpx.Response(200, text=metrics(0, 1000 * scale))
        return httpx.Response(200, text=metrics(2**20 * scale, 10 * scale))

    return httpx.MockTransport(handle)


def test_counters_sum_per_role_and_a_run_adds_their_difference() -> None:
    before = read_counters("http://router:8000", transport(1))
    after = read_counters("http://router:8000", transport(3))
    assert before is not None and after is not None
    assert before["decode"]["kv_bytes_received"] == 2 * 2**20
    assert before["prefill"]["prompt_tokens"] == 1000
    delta = counters_delta(before, after, num_completed=4)
    assert delta is not None
    assert delta["roles"]["decode"]["kv_bytes_received"] == 4 * 2**20
    assert delta["roles"]["prefill"]["prompt_tokens"] == 2000
    assert delta["kv_mib_per_request"] == 1.0
    assert counters_delta(None, after, 4) is None
    assert counters_delta(before, after, 0)["kv_mib_per_request"] is None  # type: ignore[index]


def test_an_unreadable_router_gives_no_counters() -> None:
    down = httpx.MockTransport(lambda request: httpx.Response(503, text="no"))
    assert read_counters("http://router:8000", down) is None
