"""Weight updates on a real cluster (``pdserve up``: one prefill, one decode worker, vLLM,
float32): a checkpoint with perturbed weights (made here from the default model) goes in
through ``POST /update_weights_from_disk`` on the router's admin listener, in place.

The oracle is one aggregated vLLM per checkpoint (``reference_engine.py``), greedy: after
the update, a local and a remote request give the perturbed engine's tokens; under
streaming load, every response's version (``system_fingerprint``, the same on every
chunk, and the ``x-weight-version`` header) names the checkpoint whose engine gave its
tokens. The cluster is this module's own (an admin listener, and its weights change)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from integration.pd_cases import LOCAL_PREFILL_MAX_TOKENS, LONG, MODEL
from pdserve_testing import Server, kill_cluster, launch_up, wait_until

from pdserve.bench.checkpoints import perturb_checkpoint
from pdserve.core import process
from pdserve.core.ports import free_port

pytestmark = pytest.mark.integration

MAX_TOKENS = 16
STARTUP_TIMEOUT_S = 600
REFERENCE_TIMEOUT_S = 600


@dataclass
class Cluster:
    server: Server
    admin: str
    original: Path
    perturbed: Path
    prompts: list[list[int]]  # [short (local), long (remote), ...]
    refs: dict[str, list[list[int]]] = field(default_factory=dict)  # checkpoint -> tokens

    def update(self, path: Path, version: str, policy: str = "drain") -> httpx.Response:
        return httpx.post(f"{self.admin}/update_weights_from_disk", timeout=300,
                          json={"model_path": str(path), "weight_version": version,
                                "policy": policy})

    def info(self) -> dict[str, Any]:
        return httpx.get(f"{self.admin}/weight_info", timeout=10).json()

    def complete(self, prompt: list[int]) -> tuple[list[int], str, str]:
        """Greedy: (token ids, system_fingerprint, x-weight-version header)."""
        r = httpx.post(self.server.base_url + "/completions", timeout=300, json={
            "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        return (body["choices"][0]["token_ids"], body.get("system_fingerprint", ""),
                r.headers.get("x-weight-version", ""))


def _references(model: Path, prompts: list[list[int]], folder: Path
                ) -> subprocess.Popen[bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "in.json").write_text(json.dumps(
        [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS} for p in prompts]))
    script = Path(__file__).with_name("reference_engine.py")
    return process.spawn([sys.executable, str(script), str(model), str(folder / "in.json"),
                          str(folder / "out.json"), "float32"], log_path=folder / "engine.log")


@pytest.fixture(scope="module")
def cluster(model_path: Path, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("weights")
    perturbed = perturb_checkpoint(model_path, folder / "perturbed", seed=1)
    prompts = [tokenizer.encode(text) for text in (
        "The capital of France is", "Once upon a time, in a small village by the sea,",
        LONG + "\nQuestion: which way does the river run?\nAnswer:")]
    assert len(prompts[0]) < LOCAL_PREFILL_MAX_TOKENS < len(prompts[2])
    refs = {name: _references(path, prompts, folder / name)
            for name, path in (("original", model_path), ("perturbed", perturbed))}
    admin_port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PDSERVE_CACHE=os.environ.get("PDSERVE_CACHE", str(model_path.parents[1])))
    server = launch_up(["--dtype", "float32", "--port", str(free_port()), "--kv-cache-gib", "1",
                        "--max-model-len", "4096", "--disagg", "auto",
                        "--local-prefill-max-tokens", str(LOCAL_PREFILL_MAX_TOKENS),
                        "--admin-port", str(admin_port)], env, STARTUP_TIMEOUT_S,
                       log_path=folder / "up.log")
    c = Cluster(server, f"http://127.0.0.1:{admin_port}", model_path, perturbed, prompts)
    try:
        for name, proc in refs.items():
            assert proc.wait(timeout=REFERENCE_TIMEOUT_S) == 0, f"reference {name} failed"
            c.refs[name] = json.loads((folder / name / "out.json").read_text())
        assert c.refs["original"] != c.refs["perturbed"], "the perturbation changed nothing"
        yield c
    finally:
        for proc in refs.values():
            kill_cluster(proc)
        kill_cluster(server.proc)


def test_an_update_from_disk_serves_the_new_weights_locally_and_remotely(
        cluster: Cluster) -> None:
    r = cluster.update(cluster.perturbed, "v-perturbed")
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    info = cluster.info()
    assert info["weight_version"] == "v-perturbed"
    assert len(info["workers"]) == 2 and set(info["workers"].values()) == {"v-perturbed"}
    for i in (0, 2):  # short: decode alone; long: prefill -> decode (KV under the new weights)
        tokens, fingerprint, header = cluster.complete(cluster.prompts[i])
        assert tokens == cluster.refs["perturbed"][i], f"prompt {i}"
        assert fingerprint == header == "v-perturbed"


def test_a_failed_stage_leaves_every_worker_on_its_version_serving(cluster: Cluster) -> None:
    before = cluster.info()["weight_version"]
    refs = cluster.refs["perturbed" if before == "v-perturbed" else "original"]
    bad = cluster.perturbed.parent / "not-a-checkpoint"
    bad.mkdir(exist_ok=True)
    r = cluster.update(bad, "v-bad")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_checkpoint"
    assert set(cluster.info()["workers"].values()) == {before}
    tokens, fingerprint, _ = cluster.complete(cluster.prompts[2])
    assert (tokens, fingerprint) == (refs[2], before)


def test_a_hung_worker_fails_the_stage_and_the_cluster_keeps_serving(cluster: Cluster) -> None:
    before = cluster.info()["weight_version"]
    refs = cluster.refs["perturbed" if before == "v-perturbed" else "original"]
    prefill = _worker(cluster.server, "prefill-0")
    prefill.send_signal(signal.SIGSTOP)  # a hung worker: it never answers the stage
    try:
        r = httpx.post(f"{cluster.admin}/update_weights_from_disk", timeout=60, json={
            "model_path": str(cluster.original), "weight_version": "v-hung",
            "stage_timeout_s": 3})
    finally:
        prefill.send_signal(signal.SIGCONT)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "weight_stage_failed" and "prefill-0" in r.text
    assert set(cluster.info()["workers"].values()) == {before}  # the decode dropped its stage
    tokens, fingerprint, _ = cluster.complete(cluster.prompts[2])  # remote: both serve
    assert (tokens, fingerprint) == (refs[2], before)


def _worker(server: Server, worker_id: str) -> psutil.Process:
    """``up``'s child process that is ``worker_id``."""
    for p in psutil.Process(server.proc.pid).children():
        argv = p.cmdline()
        if "--worker-id" in argv and argv[argv.index("--worker-id") + 1] == worker_id:
            return p
    raise AssertionError(f"no {worker_id} process under up")


def _stream(base_url: str, prompt: list[int], index: int, out: list[dict[str, Any]]) -> None:
    """A streamed greedy completion: its tokens, fingerprints, header, finish, status."""
    got: dict[str, Any] = {"prompt": index, "tokens": [], "fingerprints": set(),
                           "finish": None}
    try:
        with httpx.stream("POST", base_url + "/completions", timeout=300, json={
                "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "return_token_ids": True, "ignore_eos": True,
                "stream": True}) as resp:
            got["status"] = resp.status_code
            got["header"] = resp.headers.get("x-weight-version")
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    got["error"] = event["error"]
                    continue
                got["fingerprints"].add(event.get("system_fingerprint"))
                for choice in event["choices"]:
                    got["tokens"] += choice.get("token_ids") or []
                    got["finish"] = choice.get("finish_reason") or got["finish"]
    except httpx.HTTPError as exc:
        got["error"] = repr(exc)
    out.append(got)


@pytest.mark.parametrize("policy", ["drain", "abort"])
def test_a_refit_under_streaming_load_never_mixes_versions(cluster: Cluster,
                                                           policy: str) -> None:
    current = cluster.info()["weight_version"]
    target, new = ((cluster.original, f"v-original-{policy}") if current == "v-perturbed"
                   else (cluster.perturbed, "v-perturbed"))
    refs = {current: cluster.refs["perturbed" if current == "v-perturbed" else "original"],
            new: cluster.refs["perturbed" if new == "v-perturbed" else "original"]}
    results: list[dict[str, Any]] = []
    threads = [threading.Thread(target=_stream, args=(
        cluster.server.base_url, cluster.prompts[i % 3], i % 3, results)) for i in range(9)]
    for t in threads[:6]:
        t.start()
    r = cluster.update(target, new, policy)
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
        if got["finish"] != "abort":
            assert len(got["tokens"]) == MAX_TOKENS, got
        else:
            assert policy == "abort", got
    assert wait_until(lambda: _idle(cluster), 20), _loads(cluster)  # nothing leaked


def _loads(cluster: Cluster) -> list[dict[str, Any]]:
    return [w["load"] for w in httpx.get(cluster.server.base_url.removesuffix("/v1")
                                          + "/workers", timeout=10).json()["workers"]]


def _idle(cluster: Cluster) -> bool:
    """No request, call or KV block held on any worker (their next probe says so)."""
    return all(load["num_running_reqs"] == load["num_waiting_reqs"] == 0
               and load["num_inflight_reqs"] == 0 and load["kv_cache_usage"] == 0
               for load in _loads(cluster))
