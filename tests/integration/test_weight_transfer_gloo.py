"""vLLM's transfer-engine path moving real tensors into a real engine, on CPUs: a
trainer (this test) pushes a perturbed checkpoint's tensors through the router's admin
routes (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` in
two rounds, ``finish_weight_update``) into a pdserve worker started with
``--weight-transfer-backend gloo``: the routes' bodies become ``EngineWeightCall``'s
typed messages, the worker hands them to vLLM's ``AsyncLLM``, and vLLM's worker runs its
weight-transfer engine (pdserve's gloo one, ``worker/gloo_transfer.py``: vLLM's own nccl
and ipc engines need CUDA), which receives each tensor the trainer broadcasts and loads
it with vLLM's layerwise reload.

The oracle: one aggregated vLLM engine loaded from the perturbed checkpoint, float32,
greedy. Before the push the worker's tokens differ from it (the push is what changes
them); after it they are the same, under the version the finish named. One engine in
the cluster (``--num-prefill 0``), started while the oracle's loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from integration.oracles import reference_requests
from integration.pd_cases import MODEL
from pdserve_testing import Server, kill_cluster, launch_up, stop_up

from pdserve.bench.checkpoints import perturb_checkpoint
from pdserve.core import process
from pdserve.core.ports import free_port

pytestmark = pytest.mark.integration

TIMEOUT_S = 600
VERSION = "v-pushed"
PROMPTS = (0, 1)  # CASES' short completions


@dataclass
class Pushed:
    """The perturbed checkpoint, the requests, and the one engine computing its greedy
    tokens (started first, it loads beside the cluster's engine)."""

    perturbed: Path
    requests: list[dict[str, Any]]
    proc: subprocess.Popen[bytes]
    out: Path

    def expected(self) -> list[list[int]]:
        assert self.proc.wait(timeout=TIMEOUT_S) == 0, "the perturbed reference failed"
        return json.loads(self.out.read_text())


@pytest.fixture(scope="module")
def pushed(model_path: Path, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Pushed]:
    folder = tmp_path_factory.mktemp("gloo-weights")
    perturbed = perturb_checkpoint(model_path, folder / "perturbed", seed=3)
    requests = [reference_requests(tokenizer)[i] for i in PROMPTS]
    (folder / "in.json").write_text(json.dumps(requests))
    script = Path(__file__).with_name("reference_engine.py")
    proc = process.spawn([sys.executable, str(script), str(perturbed), str(folder / "in.json"),
                          str(folder / "out.json"), "float32"], log_path=folder / "engine.log")
    try:
        yield Pushed(perturbed, requests, proc, folder / "out.json")
    finally:
        kill_cluster(proc)


@pytest.fixture
def cluster(model_path: Path, tmp_path: Path) -> Iterator[Server]:
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PDSERVE_CACHE=os.environ.get("PDSERVE_CACHE", str(model_path.parents[1])))
    admin_port = free_port()
    server = launch_up(["--dtype", "float32", "--port", str(free_port()), "--kv-cache-gib", "1",
                        "--max-model-len", "4096", "--num-prefill", "0", "--num-decode", "1",
                        "--disagg", "never", "--admin-port", str(admin_port),
                        "--weight-transfer-backend", "gloo",
                        "--weight-transfer-allow", "127.0.0.1/32"],
                       env, TIMEOUT_S, log_path=tmp_path / "up.log")
    try:
        yield replace(server, admin_url=f"http://127.0.0.1:{admin_port}")
    finally:
        stop_up(server.proc)


def _complete(server: Server, request: dict[str, Any]) -> tuple[list[int], str]:
    r = httpx.post(server.base_url + "/completions", timeout=300, json={
        "model": MODEL, "prompt": request["prompt_token_ids"],
        "max_tokens": request["max_tokens"], "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], r.json().get("system_fingerprint", "")


def _beside(trainer_side: Callable[[], Any], admin_call: Callable[[], httpx.Response]
            ) -> tuple[Any, httpx.Response]:
    """``admin_call`` (it blocks in the worker until the trainer's side has run) while
    ``trainer_side`` runs in a thread: a rendezvous or a broadcast needs both."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = trainer_side()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    reply = admin_call()
    thread.join(TIMEOUT_S)
    assert not thread.is_alive(), "the trainer's side never finished"
    if "error" in out:
        raise out["error"]
    return out.get("value"), reply


def test_a_trainer_pushes_tensors_through_the_router_into_a_cpu_engine(
        pushed: Pushed, cluster: Server) -> None:
    from safetensors.torch import load_file

    from pdserve.worker.gloo_transfer import GlooTrainer

    perturbed, requests, expected = pushed.perturbed, pushed.requests, pushed.expected()
    admin = cluster.admin_url
    before = [_complete(cluster, r) for r in requests]
    assert [tokens for tokens, _ in before] != expected, "the perturbation changed nothing"
    assert {fingerprint for _, fingerprint in before} == {"default"}

    port = free_port()
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                 "world_size": 2}
    trainer, reply = _beside(
        lambda: GlooTrainer.open("127.0.0.1", port, world_size=2),
        lambda: httpx.post(f"{admin}/init_weight_transfer_engine", timeout=TIMEOUT_S,
                           json={"init_info": init_info}))
    try:
        assert reply.status_code == 200, reply.text
        reply = httpx.post(f"{admin}/start_weight_update", timeout=TIMEOUT_S)
        assert reply.status_code == 200, reply.text
        tensors = sorted(load_file(str(next(perturbed.glob("*.safetensors")))).items())
        half = len(tensors) // 2
        for chunk in (tensors[:half], tensors[half:]):  # two rounds, as trainers send them
            _, reply = _beside(lambda c=chunk: trainer.send(c), lambda c=chunk: httpx.post(
                f"{admin}/update_weights", timeout=TIMEOUT_S,
                json={"update_info": GlooTrainer.update_info(c)}))
            assert reply.status_code == 200, reply.text
        reply = httpx.post(f"{admin}/finish_weight_update", timeout=TIMEOUT_S,
                           json={"weight_version": VERSION})
        assert reply.status_code == 200, reply.text
    finally:
        httpx.post(f"{admin}/shutdown_weight_transfer_engine", timeout=60)
        trainer.close()

    after = [_complete(cluster, r) for r in requests]
    assert [tokens for tokens, _ in after] == expected
    assert {fingerprint for _, fingerprint in after} == {VERSION}
    assert httpx.get(f"{admin}/weight_info", timeout=10).json()["weight_version"] == VERSION
