"""Weight updates on the shared tcp cluster (``TCP``: one prefill, one decode worker,
vLLM, float32, mutual TLS, etcd): a checkpoint with perturbed weights (the session's,
``refits.py``, made from the default model) goes in through ``POST
/update_weights_from_disk`` on the router's admin listener, in place.

The oracle is aggregated vLLM per checkpoint, greedy (``refits.py``). After the update, a
local and a remote request give the perturbed engine's tokens; under streaming load,
every response's version (``system_fingerprint``, the same on every chunk, and the
``x-weight-version`` header) names the checkpoint whose engine gave its tokens. Each test
leaves the cluster on the model's own weights under vLLM's ``default`` version, as the
tests after it expect."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from integration.pd_cases import MODEL
from integration.refits import ORIGINAL, PERTURBED, Checkpoints, stream, update
from pdserve_testing import Server, wait_until

pytestmark = pytest.mark.integration


@dataclass
class Cluster:
    server: Server
    ckpt: Checkpoints

    @property
    def admin(self) -> str:
        return self.server.admin_url

    def update(self, path: Path, version: str, policy: str = "drain") -> httpx.Response:
        return update(self.admin, path, version, policy)

    def info(self) -> dict[str, Any]:
        return httpx.get(f"{self.admin}/weight_info", timeout=10).json()

    def complete(self, i: int) -> tuple[list[int], str, str]:
        """Greedy request ``i``: (token ids, system_fingerprint, x-weight-version)."""
        req = self.ckpt.requests[i]
        r = httpx.post(self.server.base_url + "/completions", timeout=300, json={
            "model": MODEL, "prompt": req["prompt_token_ids"], "max_tokens": req["max_tokens"],
            "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        return (body["choices"][0]["token_ids"], body.get("system_fingerprint", ""),
                r.headers.get("x-weight-version", ""))


@pytest.fixture
def cluster(pd_server: Server, checkpoints: Checkpoints) -> Iterator[Cluster]:
    c = Cluster(pd_server, checkpoints)
    try:
        yield c
    finally:  # back on the model's own weights, as the next tests expect them
        if c.info()["weight_version"] != ORIGINAL:
            r = c.update(checkpoints.original, ORIGINAL)
            assert r.status_code == 200, r.text


def test_an_update_from_disk_serves_the_new_weights_locally_and_remotely(
        cluster: Cluster) -> None:
    r = cluster.update(cluster.ckpt.perturbed, PERTURBED)
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    info = cluster.info()
    assert info["weight_version"] == PERTURBED
    assert len(info["workers"]) == 2 and set(info["workers"].values()) == {PERTURBED}
    for i in (0, 2):  # short: decode alone; long: prefill -> decode (KV under the new weights)
        tokens, fingerprint, header = cluster.complete(i)
        assert tokens == cluster.ckpt.refs[PERTURBED][i], f"prompt {i}"
        assert fingerprint == header == PERTURBED


def test_a_failed_stage_leaves_every_worker_on_its_version_serving(cluster: Cluster) -> None:
    bad = cluster.ckpt.perturbed.parent / "not-a-checkpoint"
    bad.mkdir(exist_ok=True)
    r = cluster.update(bad, "v-bad")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_checkpoint"
    assert set(cluster.info()["workers"].values()) == {ORIGINAL}
    tokens, fingerprint, _ = cluster.complete(2)
    assert (tokens, fingerprint) == (cluster.ckpt.refs[ORIGINAL][2], ORIGINAL)


def test_a_hung_worker_fails_the_stage_and_the_cluster_keeps_serving(cluster: Cluster) -> None:
    prefill = _worker(cluster.server, "prefill-0")
    prefill.send_signal(signal.SIGSTOP)  # a hung worker: it never answers the stage
    try:
        r = httpx.post(f"{cluster.admin}/update_weights_from_disk", timeout=60, json={
            "model_path": str(cluster.ckpt.perturbed), "weight_version": "v-hung",
            "stage_timeout_s": 2})
    finally:
        prefill.send_signal(signal.SIGCONT)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "weight_stage_failed" and "prefill-0" in r.text
    assert set(cluster.info()["workers"].values()) == {ORIGINAL}  # the decode dropped its stage
    tokens, fingerprint, _ = cluster.complete(0)  # the decode serves at once, prefill or not
    assert (tokens, fingerprint) == (cluster.ckpt.refs[ORIGINAL][0], ORIGINAL)


def _worker(server: Server, worker_id: str) -> psutil.Process:
    """``up``'s child process that is ``worker_id``."""
    for p in psutil.Process(server.proc.pid).children():
        argv = p.cmdline()
        if "--worker-id" in argv and argv[argv.index("--worker-id") + 1] == worker_id:
            return p
    raise AssertionError(f"no {worker_id} process under up")


@pytest.mark.parametrize("policy", ["drain", "abort"])
def test_a_refit_under_streaming_load_never_mixes_versions(cluster: Cluster,
                                                           policy: str) -> None:
    refs = cluster.ckpt.refs
    reruns_before = cluster.server.metric("pdserve:weight_update_reruns_total")
    results: list[dict[str, Any]] = []
    threads = [threading.Thread(target=stream, args=(
        cluster.server.base_url, cluster.ckpt.requests[i % 3], i % 3, results))
        for i in range(9)]
    for t in threads[:6]:
        t.start()
    r = cluster.update(cluster.ckpt.perturbed, PERTURBED, policy)
    for t in threads[6:]:  # arrive after the switch, or wait for it at the gate
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert r.status_code == 200, r.text
    assert len(results) == 9
    for got in results:
        assert got.get("status") == 200 and "error" not in got, got
        assert len(got["fingerprints"]) == 1, got  # one version on every chunk
        version = got["fingerprints"].pop()
        assert version == got["header"] and version in refs, got
        expected = refs[version][got["prompt"]]
        assert got["tokens"] == expected[:len(got["tokens"])], (version, got, expected)
        if got["finish"] == "abort":
            assert policy == "abort", got
        else:  # whole: the reference's length (it stops where vLLM stops)
            assert got["tokens"] == expected, (version, got, expected)
    cut = sum(got["finish"] == "abort" for got in results)
    reruns = cluster.server.metric("pdserve:weight_update_reruns_total") - reruns_before
    if policy == "abort":  # it ended what ran: cut what had been sent, ran the rest again
        assert cut + reruns >= 1, results
    else:
        assert cut == reruns == 0, results
    assert wait_until(lambda: _idle(cluster), 20), _loads(cluster)  # nothing leaked


def _loads(cluster: Cluster) -> list[dict[str, Any]]:
    return [w["load"] for w in httpx.get(cluster.server.base_url.removesuffix("/v1")
                                          + "/workers", timeout=10).json()["workers"]]


def _idle(cluster: Cluster) -> bool:
    """No request, call or KV block held on any worker (their next probe says so)."""
    return all(load["num_running_reqs"] == load["num_waiting_reqs"] == 0
               and load["num_inflight_reqs"] == 0 and load["kv_cache_usage"] == 0
               for load in _loads(cluster))
