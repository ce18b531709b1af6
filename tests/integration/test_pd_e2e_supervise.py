"""``pdserve up`` supervising real vLLM workers, on the shared tcp cluster
(``pd_server``; this file sorts after ``test_pd_e2e.py`` and before the transport
clusters, so it reuses that cluster): the prefill worker is SIGKILLed, every
request meanwhile still gets vLLM's answer (decode prefills it), and the worker is
restarted on its port, with its engine, and rejoins the router's view; then the
router is SIGKILLed mid-stream: both workers free the request (its engine requests
aborted, its KV freed) within the KV lease time, and the router is restarted. Each
test waits for the restart, so the cluster it leaves is whole."""

from __future__ import annotations

import signal

import httpx
import openai
import psutil
import pytest
from integration.pd_cases import CASES, LONG, MODEL, run_case
from pdserve_testing import Server, read_events, wait_until

pytestmark = pytest.mark.integration

# A vLLM engine starts in ~35 s on two cores; back-off 1 s; router health every 2 s.
REJOIN_TIMEOUT_S = 240


def _worker(server: Server, worker_id: str) -> psutil.Process | None:
    """``up``'s child that is ``worker_id``, or ``router``."""
    for p in psutil.Process(server.proc.pid).children():
        try:
            argv = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if worker_id == "router" and argv[3:4] == ["router"]:
            return p
        if "--worker-id" in argv and argv[argv.index("--worker-id") + 1] == worker_id:
            return p
    return None


def _healthy(server: Server, worker_id: str) -> bool:
    return any(w["id"] == worker_id and w["healthy"] for w in server.workers("prefill"))


def test_sigkilled_prefill_worker_is_restarted_and_rejoins_while_answers_stay_exact(
    pd_server: Server, reference: list[list[int]]
) -> None:
    victim = _worker(pd_server, "prefill-0")
    assert victim is not None and _healthy(pd_server, "prefill-0")
    (endpoint,) = [w["endpoint"] for w in pd_server.workers("prefill")]
    engines = victim.children(recursive=True)
    client = openai.OpenAI(base_url=pd_server.base_url, api_key="none", timeout=300)
    victim.send_signal(signal.SIGKILL)
    # Its engine is in its process group: the supervisor kills it, no orphan is left.
    gone = wait_until(lambda: not any(e.is_running() and e.status() != psutil.STATUS_ZOMBIE
                                      for e in engines), timeout_s=30)
    assert gone, "the dead worker's engine processes survived it"
    # The router notices at its next health check (every 2 s); the new engine takes
    # ~35 s to load, so prefill-0 stays unhealthy meanwhile.
    assert wait_until(lambda: not _healthy(pd_server, "prefill-0"), timeout_s=15)
    # While prefill-0 is down (its new engine loading), decode prefills: every answer is
    # still vLLM's. Once: more rounds would only slow the engine loading beside them.
    for case, want in zip(CASES, reference, strict=True):
        _, ids = run_case(client, case)
        assert ids == want, f"{case.kind} stream={case.stream}: answer changed meanwhile"
    assert wait_until(lambda: _healthy(pd_server, "prefill-0"), REJOIN_TIMEOUT_S, 1.0), \
        pd_server.log_lines("prefill-0", "exited", "restart")
    back = _worker(pd_server, "prefill-0")
    assert back is not None and back.pid != victim.pid
    assert [w["endpoint"] for w in pd_server.workers("prefill")] == [endpoint]
    # up says so at its next probe of the child (the router may have seen it first:
    # on etcd a worker is placeable once it registers).
    assert wait_until(lambda: pd_server.log_lines("prefill-0 is back (restart 1)"), 15)
    for case, want in zip(CASES, reference, strict=True):  # and P/D again
        assert run_case(client, case)[1] == want



LEASE_S = 30.0  # the workers' --lease-s default: how long prefill keeps unclaimed KV


def test_router_killed_mid_stream_both_workers_free_the_request(
    pd_server: Server, reference: list[list[int]]
) -> None:
    assert wait_until(pd_server.idle, timeout_s=15), pd_server.holding()
    router = _worker(pd_server, "router")
    assert router is not None
    endpoints = {role: pd_server.workers(role)[0]["endpoint"] for role in ("prefill", "decode")}
    body = {"model": MODEL, "prompt": "Count: " + LONG, "max_tokens": 1000,
            "temperature": 0, "ignore_eos": True, "stream": True}  # long: P -> D
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", pd_server.base_url + "/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            read_events(lines, 3)
            assert pd_server.load("decode").num_inflight_reqs == 1
            router.send_signal(signal.SIGKILL)
            with pytest.raises(httpx.HTTPError):  # the stream is cut
                for _ in lines:
                    pass
    # The router is down: ask the workers themselves.
    assert wait_until(lambda: pd_server.idle(endpoints), timeout_s=LEASE_S + 10), \
        "a worker still holds the request"
    # The supervisor restarts the router on its port; it finds both workers again.
    back = wait_until(lambda: (_worker(pd_server, "router") or router).pid != router.pid
                      and _all_healthy(pd_server), timeout_s=REJOIN_TIMEOUT_S, interval_s=1)
    assert back, pd_server.log_lines("router", "restart")
    client = openai.OpenAI(base_url=pd_server.base_url, api_key="none", timeout=300)
    assert run_case(client, CASES[0])[1] == reference[0]  # serves again, exactly


def _all_healthy(server: Server) -> bool:
    try:
        workers = server.workers("prefill") + server.workers("decode")
        return len(workers) == 2 and all(w["healthy"] for w in workers)
    except (httpx.HTTPError, ValueError, KeyError):
        return False
