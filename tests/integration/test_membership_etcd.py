"""Membership on a real etcd with real vLLM workers (``pdserve prefill|decode --etcd``)
and a real router (``pdserve router --etcd``), one cluster shared by the module, each
process on a host of its own (``hosted.py``: network namespaces, links at 10 Gbit/s; the
test's thread on a client host), or on loopback where this machine cannot make hosts
(then the partitions skip, with the reason).

The tests run in file order on that cluster: discovery within 2 s, spread over
2 prefill + 2 decode, the decode worker serving a long greedy stream SIGSTOPped
(keepalive notices, the stream moves to the other decode worker, the answer is
unchanged) then SIGKILLed (the same, and it leaves the view within its TTL), SIGSTOP
of a prefill worker past the TTL then SIGCONT, an etcd outage and restart (a worker
started during it is discovered: a bfloat16 decode worker, incompatible with the
float32 prefill workers), and the incompatible worker never paired (it serves alone,
computing prompts itself), then SIGTERM to that worker mid-stream (it drains). At
most four engines run at once. Workers use a 3 s lease
TTL (``--etcd-ttl-s 3``; the default is 10 s).

The partitions (issue 43's part 3), each under a few concurrent streams, between the
SIGSTOP and the SIGKILL tests: the router cut from a decode worker mid-stream, prefill
cut from decode during the KV pulls, an asymmetric cut (prefill's packets to the router
dropped, the router's to prefill not), a worker cut from etcd, the router cut from etcd.
The SIGSTOP test is the frozen peer. Each: every stream ends within its deadline with the
uninterrupted answer, and within a bound after healing the cluster is whole (every worker
registered and healthy in the router's view, none holding a request, a block or a
lease); the time that took is written to ``heal-times.json`` in the module's log folder.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from integration.etcd_cluster import (
    DECODES,
    DRAIN_BODY,
    DRAIN_GRACE_S,
    DRAIN_REPEAT,
    ENGINE_START_S,
    ETCD_SLACK_S,
    KILL_AFTER_TOKENS,
    LATE,
    MIGRATION_TOKENS,
    PREFILLS,
    PREFIX,
    PULL_LINK_GBIT,
    ROUTABLE_S,
    STREAM_S,
    STREAMS,
    TTL_S,
    WHOLE_S,
    WORKERS,
    Cluster,
    answers,
    running_cluster,
)
from pdserve_testing import etcd_keys, sse_events, token_ids, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(model_path, tmp_path_factory.mktemp("etcd-cluster")) as c:
        yield c


def test_registered_workers_are_routable_at_once(cluster: Cluster) -> None:
    t = cluster.timeline
    for worker_id in WORKERS:
        registered = t.first(t.registered, worker_id)
        assert t.first(t.routable, worker_id, registered) - registered <= ROUTABLE_S, worker_id
    keys = etcd_keys(cluster.etcd.url, PREFIX)
    info = json.loads(keys[PREFIX + "decode/decode-0"])
    assert info["grpc_endpoint"] == cluster.endpoints["decode-0"]
    assert info["dtype"] == "float32" and info["block_size"] > 0 and info["compatibility_hash"]
    assert set(info["kv_endpoints"]) == {"tcp"} and info["capacity"]["num_kv_blocks"] > 0


def test_requests_spread_over_two_prefill_and_two_decode(cluster: Cluster) -> None:
    before = {w: cluster.load(w) for w in WORKERS}
    for i in range(6):
        cluster.complete(i)
    after = {w: cluster.load(w) for w in WORKERS}
    for worker_id in ("prefill-0", "prefill-1"):
        assert (after[worker_id].prompt_tokens_computed
                > before[worker_id].prompt_tokens_computed), worker_id
    for worker_id in ("decode-0", "decode-1"):  # KV from P
        assert (after[worker_id].prompt_tokens_external
                > before[worker_id].prompt_tokens_external), worker_id


def test_decode_switches_role_mid_stream_the_stream_is_uncut_then_it_serves_prefill(
        cluster: Cluster) -> None:
    """``POST /admin/workers/{id}/role`` on the decode worker serving a greedy stream,
    with no drain time: its stream is aborted there and continues on the other decode
    worker (migration), the client's text is the uninterrupted one (which equals one
    aggregated engine's: tests/integration/test_pd_e2e.py), the same process and engine
    then serves prefill (its key moved in etcd), and no worker holds a block. It is
    switched back to decode after (drained), for the tests after this one."""
    want = cluster.reference_answer()
    before = cluster.metric("pdserve:migrations_total", 'reason="')
    switched: list[dict[str, Any]] = []
    got, usage, serving = cluster.stream(
        act_after=KILL_AFTER_TOKENS,
        act=lambda w: switched.append(cluster.switch_role(w, "prefill", drain_timeout_s=0)))
    assert serving and switched, "the stream ended before the switch"
    (result,) = switched
    assert got == want.ids, "the answer through the switch differs from the uninterrupted one"
    assert usage["completion_tokens"] == MIGRATION_TOKENS
    assert (result["role"], result["previous_role"], result["changed"]) == (
        "prefill", "decode", True)
    # Cut there after 16 of 64 tokens (no drain time), continued on the other decode.
    assert result["num_aborted"] == 1
    assert cluster.metric("pdserve:migrations_total", 'reason="') == before + 1
    other = "decode-1" if serving == "decode-0" else "decode-0"
    pid = cluster.procs[serving].pid
    loaded = cluster.load(other).prompt_tokens_external
    try:
        keys = etcd_keys(cluster.etcd.url, PREFIX)
        assert PREFIX + f"prefill/{serving}" in keys and PREFIX + f"decode/{serving}" not in keys
        assert wait_until(lambda: cluster.view().get(serving, {}).get("role") == "prefill"
                          and cluster.view()[serving]["healthy"], ROUTABLE_S)
        computed = cluster.load(serving).prompt_tokens_computed
        for i in range(6):  # round robin over three prefill workers now
            cluster.complete(100 + i)
        assert cluster.load(serving).prompt_tokens_computed > computed, "it never prefilled"
        assert cluster.load(other).prompt_tokens_external > loaded  # KV from P, as before
        assert cluster.procs[serving].poll() is None and cluster.procs[serving].pid == pid
    finally:
        back = cluster.switch_role(serving, "decode")
        assert back["role"] == "decode" and back["num_aborted"] == 0
        assert wait_until(lambda: {w for w, v in cluster.view().items() if v["healthy"]
                                   and v["role"] == "decode"} >= {"decode-0", "decode-1"},
                          ROUTABLE_S + ETCD_SLACK_S)
    # Nothing leaked: no request in flight or running, no block held, no lease left.
    assert wait_until(lambda: all(cluster.idle(w) and not cluster.load(w).kv_leases_held
                                  for w in WORKERS), 30.0)


def test_decode_paused_mid_stream_the_stream_moves_and_the_answer_is_unchanged(
        cluster: Cluster) -> None:
    """The frozen peer: SIGSTOP of decode-0 (a hung worker, not a dead one) while
    STREAMS greedy streams run, at the first one's 16th token (round robin gave it at
    least one). gRPC keepalive notices within seconds, not at the request's deadline,
    and the router continues each of its streams on the other decode worker from prompt +
    the tokens sent; the other streams go on. Resumed, it re-registers, drops the
    abandoned requests and serves again."""
    want = cluster.partition_reference()
    before = cluster.metric("pdserve:migrations_total", 'reason="')
    try:
        outcomes = cluster.streams(lambda: cluster.signal("decode-0", signal.SIGSTOP),
                                   after_tokens=KILL_AFTER_TOKENS)
        answers(outcomes, want)
        assert max(o.seconds for o in outcomes) < want.seconds * STREAMS + 30  # not 600 s
        assert cluster.metric("pdserve:migrations_total", 'reason="') >= before + 1
    finally:
        cluster.signal("decode-0", signal.SIGCONT)
    assert wait_until(lambda: "decode-0" in cluster.healthy(), TTL_S + 10, 0.1)
    assert wait_until(lambda: cluster.idle("decode-0"), 30.0, 0.5), "decode-0 holds KV"


def test_router_cut_from_a_decode_worker_mid_stream_its_streams_move(cluster: Cluster) -> None:
    """The router and decode-0 partitioned (both ways, packets dropped silently) at the
    first stream's 16th token: keepalive notices, decode-0's streams continue on decode-1,
    every answer is the uninterrupted one; healed, decode-0 is back and idle."""
    want = cluster.partition_reference()
    before = cluster.metric("pdserve:migrations_total", 'reason="')
    try:
        outcomes = cluster.streams(lambda: cluster.net.cut("router", "decode-0", both=True),
                                   after_tokens=KILL_AFTER_TOKENS)
    finally:
        healed = cluster.heal()
    answers(outcomes, want)
    assert cluster.metric("pdserve:migrations_total", 'reason="') >= before + 1
    cluster.whole("router | decode-0, mid-stream", healed)


def test_prefill_cut_from_decode_during_the_kv_pulls_decode_recomputes(
        cluster: Cluster) -> None:
    """Each prefill's link at PULL_LINK_GBIT (a long prompt's KV takes seconds), then
    every prefill and decode partitioned at the first token (when the first pull has
    begun): each pull stalls, fails after --kv-stall-s, and decode recomputes the prompt
    (vLLM's recompute policy); every answer is the uninterrupted one. Healed, the
    prefills' leases that no decode could release lapse (--lease-s)."""
    net, want = cluster.net, cluster.partition_reference()
    failed = sum(cluster.load(d).kv_transfers_failed for d in DECODES)

    def cut() -> None:
        for p in PREFILLS:
            for d in DECODES:
                net.cut(p, d, both=True)

    for p in PREFILLS:
        net.shape(p, PULL_LINK_GBIT)
    try:
        outcomes = cluster.streams(cut, after_tokens=1)
    finally:
        healed = cluster.heal()
    answers(outcomes, want)
    assert sum(cluster.load(d).kv_transfers_failed for d in DECODES) > failed
    cluster.whole("prefill | decode, during the KV pulls", healed)


def test_prefill_cut_from_the_router_one_way_decode_computes_the_prompts(
        cluster: Cluster) -> None:
    """Asymmetric: the router reaches the prefill workers, their packets to it are
    dropped, from just after the streams are sent. The router's calls get no answer,
    keepalive gives up, and decode computes the prompts itself (a prefill fallback);
    every answer is the uninterrupted one."""
    net, want = cluster.net, cluster.partition_reference()
    fallbacks = cluster.metric("pdserve:prefill_fallbacks_total")

    def cut() -> None:
        for p in PREFILLS:
            net.cut(p, "router")

    try:
        outcomes = cluster.streams(cut)
    finally:
        healed = cluster.heal()
    answers(outcomes, want)
    assert cluster.metric("pdserve:prefill_fallbacks_total") >= fallbacks + 1
    cluster.whole("prefill -> router (one way)", healed)


def test_a_worker_cut_from_etcd_leaves_the_view_and_rejoins_when_healed(
        cluster: Cluster) -> None:
    """prefill-1 and etcd partitioned: its lease lapses within the TTL and it leaves the
    router's view while the streams are served by the others; healed, it registers
    again, is routable and serves."""
    net, want = cluster.net, cluster.partition_reference()
    left: list[float] = []  # when the router's view lost it, watched while streams run

    def watch() -> None:
        if wait_until(lambda: "prefill-1" not in cluster.view(), TTL_S + ETCD_SLACK_S, 0.1):
            left.append(time.monotonic())

    net.cut("prefill-1", "etcd", both=True)
    cut = time.monotonic()
    try:
        outcomes = cluster.streams(watch)  # returns once the streams and the watch ended
        assert left, "prefill-1 never left the view"
        assert left[0] - cut <= TTL_S + ETCD_SLACK_S
    finally:
        healed = cluster.heal()
    answers(outcomes, want)
    cluster.whole("prefill-1 | etcd", healed)
    computed = cluster.load("prefill-1").prompt_tokens_computed
    for j in range(4):
        cluster.complete(700 + j)
    assert cluster.load("prefill-1").prompt_tokens_computed > computed


def test_the_router_cut_from_etcd_serves_on_its_last_view(cluster: Cluster) -> None:
    """The router and etcd partitioned past the workers' TTL: it says etcd is down,
    keeps every worker it knew, and serves the streams; healed, it is back on etcd."""
    net, want = cluster.net, cluster.partition_reference()
    before = cluster.healthy()
    net.cut("router", "etcd", both=True)
    ends = time.monotonic() + TTL_S + 1
    try:
        outcomes = cluster.streams(lambda: None)
        assert wait_until(lambda: cluster.metric("pdserve:membership_etcd_up") == 0,
                          TTL_S + ETCD_SLACK_S)
        time.sleep(max(0.0, ends - time.monotonic()))
        assert cluster.healthy() == before
    finally:
        healed = cluster.heal()
    answers(outcomes, want)
    assert wait_until(lambda: cluster.metric("pdserve:membership_etcd_up") == 1, WHOLE_S)
    cluster.whole("router | etcd", healed)


def test_decode_killed_mid_stream_the_answer_is_unchanged_and_it_leaves_the_view(
        cluster: Cluster) -> None:
    """SIGKILL of the decode worker serving a long greedy stream: the client's answer is
    the uninterrupted one, token for token; the worker leaves the view within its TTL;
    requests keep succeeding; no KV is left held on the survivor."""
    want = cluster.reference_answer()
    before = cluster.metric("pdserve:migrations_total", 'reason="')
    got, usage, killed = cluster.stream(act_after=KILL_AFTER_TOKENS, sig=signal.SIGKILL)
    killed_at = time.monotonic()
    assert killed, "the stream ended before the kill"
    assert got == want.ids, "the migrated answer differs from the uninterrupted one"
    assert usage["completion_tokens"] == MIGRATION_TOKENS  # every token counted once
    assert usage["prompt_tokens"] == want.usage["prompt_tokens"]
    assert cluster.metric("pdserve:migrations_total", 'reason="') == before + 1
    cluster.procs[killed].wait(timeout=30)
    cluster.survivor = "decode-1" if killed == "decode-0" else "decode-0"
    i = 100
    while killed in cluster.view() and time.monotonic() - killed_at < TTL_S + 5:
        cluster.complete(i)  # asserts success: served by the others meanwhile
        i += 1
    assert wait_until(lambda: killed not in cluster.view(), 1.0, interval_s=0.05)
    t = cluster.timeline
    assert max(t.listed[killed]) - killed_at <= TTL_S + ETCD_SLACK_S  # last seen in the view
    assert killed not in etcd_keys(cluster.etcd.url, PREFIX + "decode/")
    for j in range(3):
        cluster.complete(200 + j)
    assert wait_until(lambda: cluster.idle(cluster.survivor), 15.0, 0.5)


def test_paused_worker_reregisters_and_serves_again(cluster: Cluster) -> None:
    cluster.signal("prefill-1", signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        assert wait_until(lambda: "prefill-1" not in cluster.view(), TTL_S + 5, 0.1)
        assert time.monotonic() - stopped <= TTL_S + ETCD_SLACK_S
        time.sleep(1.0)
    finally:
        cluster.signal("prefill-1", signal.SIGCONT)
    resumed = time.monotonic()
    assert wait_until(lambda: "prefill-1" in cluster.healthy(), TTL_S + 5, 0.1)
    t = cluster.timeline
    assert t.first(t.registered, "prefill-1", resumed) - resumed <= TTL_S / 3 + ETCD_SLACK_S
    computed = cluster.load("prefill-1").prompt_tokens_computed
    for j in range(4):
        cluster.complete(500 + j)
    assert cluster.load("prefill-1").prompt_tokens_computed > computed


def test_etcd_outage_keeps_serving_then_discovers_a_new_worker(cluster: Cluster) -> None:
    before = cluster.healthy()
    reconnects = cluster.metric("pdserve:membership_etcd_reconnects_total")
    cluster.etcd.stop(keep_data=True)  # SIGKILL
    assert wait_until(lambda: cluster.metric("pdserve:membership_etcd_up") == 0, 5.0)
    # Registers once etcd is back; drained by the last test.
    cluster.start_worker(LATE, "decode", "bfloat16", "--drain-timeout-s", str(DRAIN_GRACE_S))
    outage_end = time.monotonic() + TTL_S + 1  # past the TTL: nothing may expire
    i = 300
    while time.monotonic() < outage_end:
        cluster.complete(i)
        i += 1
    assert cluster.healthy() == before
    restarted = time.monotonic()
    cluster.etcd.start()
    assert wait_until(lambda: LATE in cluster.healthy(), ENGINE_START_S, 0.5), (
        f"{LATE} not discovered; see {cluster.log_dir}")
    t = cluster.timeline
    assert t.first(t.registered, LATE) >= restarted
    assert t.first(t.routable, LATE) - t.first(t.registered, LATE) <= ROUTABLE_S
    assert cluster.metric("pdserve:membership_etcd_up") == 1
    assert cluster.metric("pdserve:membership_etcd_reconnects_total") >= reconnects + 1
    assert before <= cluster.healthy()
    for j in range(4):
        cluster.complete(400 + j)
    assert cluster.load(LATE).prompt_tokens_computed > 0  # it serves


def test_incompatible_worker_is_never_paired(cluster: Cluster) -> None:
    view = cluster.view()
    hashes = {i: w["compatibility_hash"] for i, w in view.items()}
    survivor = cluster.survivor
    assert view[LATE]["healthy"] and hashes[LATE] != hashes["prefill-0"] == hashes[survivor]
    no_prefill = ("pdserve:disagg_decisions_total", 'decision="local"', 'reason="no_prefill"')
    local = cluster.metric(*no_prefill)
    computed = cluster.load(LATE).prompt_tokens_computed
    external = cluster.load(survivor).prompt_tokens_external
    for j in range(6):
        cluster.complete(600 + j)
    # Round robin gave the bf16 decode worker half of these; no prefill worker may be
    # paired with it, so it computed those prompts itself (a local decision, reason
    # no_prefill: not a failed prefill) and received no KV.
    late = cluster.load(LATE)
    assert late.prompt_tokens_computed > computed
    assert (late.prompt_tokens_external, late.kv_bytes_received) == (0, 0)
    assert cluster.metric(*no_prefill) >= local + 3
    assert cluster.load(survivor).prompt_tokens_external > external


@pytest.mark.parametrize("attempt", range(DRAIN_REPEAT))
def test_sigterm_drains_a_decode_worker_its_stream_completes_and_it_exits(
        cluster: Cluster, attempt: int) -> None:
    """SIGTERM to a decode worker at its stream's first token (the last test: the worker
    is gone after it): it leaves the view at once (its lease revoked), new requests go to
    the other decode worker, its own stream completes there, not migrated, and it exits.

    Once failed on a CPU whose engines stalled 5 s per lost wake-up: the bf16 stream
    outlasted the default 30 s grace, the worker's server cancelled it (UNAVAILABLE), and
    migration, which then took only a worker of the same compatibility hash, found none.
    """
    drained_id = LATE if attempt == 0 and LATE in cluster.healthy() else f"drain-{attempt}"
    if drained_id != LATE:  # -k drain, or a repeat: a fresh bf16 worker
        cluster.start_worker(drained_id, "decode", "bfloat16", "--drain-timeout-s",
                             str(DRAIN_GRACE_S))
        assert wait_until(lambda: drained_id in cluster.healthy(), ENGINE_START_S, 0.5)
    proc = cluster.procs[drained_id]
    migrations = cluster.metric("pdserve:migrations_total", 'reason="')
    streams: list[list[int]] = []
    errors: list[BaseException] = []
    signalled = threading.Event()

    def one() -> None:
        """A stream; the one on the drained worker (no prefill can pair with it, so its
        route says no_prefill) SIGTERMs it when its first token arrives."""
        try:
            ids: list[int] = []
            with httpx.stream("POST", cluster.router_url + "/v1/completions", json=DRAIN_BODY,
                              timeout=600) as resp:
                assert resp.status_code == 200, resp.read()
                ours = "no_prefill" in resp.headers.get("x-pdserve-disagg", "")
                for event in sse_events(resp.iter_lines()):
                    assert "error" not in event, event
                    ids += token_ids(event)
                    if ours and ids and not signalled.is_set():
                        proc.send_signal(signal.SIGTERM)  # the worker, not its engine
                        signalled.set()
            streams.append(ids)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    # Round robin: of two requests at once, one lands on each decode worker.
    # One stream per decode worker: round_robin gives each one, the drained one too.
    num_decode = sum(bool(w["healthy"]) and w["role"] == "decode" for w in cluster.view().values())
    clients = [threading.Thread(target=one) for _ in range(num_decode)]
    for t in clients:
        t.start()
    assert signalled.wait(STREAM_S), f"no stream reached {drained_id}: {errors}"
    assert wait_until(lambda: drained_id not in cluster.view(), 10.0, 0.05)
    for j in range(2):
        cluster.complete(800 + 10 * attempt + j)  # served by the others meanwhile
    for t in clients:
        t.join(timeout=DRAIN_GRACE_S)
    assert not errors, errors
    assert [len(ids) for ids in streams] == [DRAIN_BODY["max_tokens"]] * num_decode
    assert cluster.metric("pdserve:migrations_total", 'reason="') == migrations  # drained
    assert proc.wait(timeout=60) == 0  # once idle, not at the grace
