"""Refits on real vLLM behind two router processes: one cluster for the module, ``pdserve
up --router-processes 2`` with one decode worker (``--num-prefill 0 --disagg never``,
float32) started with ``--weight-transfer-backend gloo``. Every call below goes through
process 1's admin listener (``--admin-port + 1``); requests reach either process (the
kernel spreads connections over the processes' shared port).

- vLLM's transfer-engine path moving real tensors into a real engine, on CPUs: a trainer
  (this test) pushes the perturbed checkpoint's tensors through the routes
  (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` in two
  rounds, ``finish_weight_update``): the bodies become ``EngineWeightCall``'s typed
  messages, the worker hands them to vLLM's ``AsyncLLM``, and vLLM's worker runs its
  weight-transfer engine (pdserve's gloo one, ``worker/vllm/gloo_transfer.py``: vLLM's own
  nccl and ipc engines need CUDA), which receives each tensor the trainer broadcasts and
  loads it with vLLM's layerwise reload. Greedy output then equals one engine loaded
  from that checkpoint, under the version the finish named, through both processes.
- ``update_weights_from_disk`` through process 1 while streams run through both, under
  each policy: no response fails or mixes versions (its tokens, token by token, are the
  old or the new engine's), ``abort`` cuts (``finish_reason: "abort"``, 200) or reruns,
  ``keep`` resumes and its ``usage.weight_versions`` spans say where: the old engine's
  tokens before the switch, after it what the new weights give after that context (the
  cluster on the new weights, itself equal to the new engine on the fixed prompts); every
  request sent once the call returned runs on the new weights.

The oracles are the session's (``refits.py``): the ``vllm serve`` of the model's own
weights and one engine run on the perturbed checkpoint."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from integration.pd_cases import MODEL
from integration.refits import ORIGINAL, PERTURBED, Checkpoints, stream, update
from pdserve_testing import Server, launch_up, router_metric, stop_up, wait_until

from pdserve.core.ports import free_port

pytestmark = pytest.mark.integration

TIMEOUT_S = 600
PUSHED = "v-pushed"
LOAD_STREAMS = 4  # streams kept running through the update, each one request after another
COMPLETIONS = 'endpoint="/v1/completions"'


@dataclass
class Fleet:
    server: Server
    admins: tuple[str, str]  # process 0's admin listener, process 1's

    @property
    def admin(self) -> str:
        """Process 1's: the one every call of these tests goes through."""
        return self.admins[1]

    def served(self) -> list[float]:
        """Completions each process has answered."""
        return [router_metric(a, "pdserve:http_requests_total", COMPLETIONS)
                for a in self.admins]

    def version(self) -> str:
        return str(httpx.get(f"{self.admins[0]}/weight_info", timeout=10).json()
                   ["weight_version"])


def _two_free_ports() -> int:
    """A port whose next one is free too (process i's admin listener: the port + i)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def fleet(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PDSERVE_CACHE=os.environ.get("PDSERVE_CACHE", str(model_path.parents[1])))
    admin_port = _two_free_ports()
    server = launch_up(["--dtype", "float32", "--port", str(free_port()), "--kv-cache-gib", "1",
                        "--max-model-len", "4096", "--num-prefill", "0", "--num-decode", "1",
                        "--disagg", "never", "--router-processes", "2",
                        "--admin-port", str(admin_port),
                        "--weight-transfer-backend", "gloo",
                        "--weight-transfer-allow", "127.0.0.1/32"],
                       env, TIMEOUT_S, log_path=tmp_path_factory.mktemp("fleet") / "up.log")
    admins = (f"http://127.0.0.1:{admin_port}", f"http://127.0.0.1:{admin_port + 1}")
    try:
        yield Fleet(replace(server, admin_url=admins[0]), admins)
    finally:
        stop_up(server.proc)


@pytest.fixture
def on_original(fleet: Fleet, checkpoints: Checkpoints) -> Iterator[Fleet]:
    """The fleet on the model's own weights, as each test begins and leaves it."""
    yield fleet
    if fleet.version() != ORIGINAL:
        r = update(fleet.admins[0], checkpoints.original, ORIGINAL)
        assert r.status_code == 200, r.text


def _complete(server: Server, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    r = httpx.post(server.base_url + "/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True})
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
        on_original: Fleet, checkpoints: Checkpoints) -> None:
    from safetensors.torch import load_file

    from pdserve.worker.vllm.gloo_transfer import GlooTrainer

    fleet, server, admin = on_original, on_original.server, on_original.admin
    requests, expected = checkpoints.requests, checkpoints.refs[PERTURBED]
    before = [_complete(server, r["prompt_token_ids"], r["max_tokens"]) for r in requests]
    assert [tokens for tokens, _ in before] == checkpoints.refs[ORIGINAL]
    assert {fingerprint for _, fingerprint in before} == {ORIGINAL}

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
        tensors = sorted(load_file(str(next(checkpoints.perturbed.glob("*.safetensors"))))
                         .items())
        half = len(tensors) // 2
        for chunk in (tensors[:half], tensors[half:]):  # two rounds, as trainers send them
            _, reply = _beside(partial(trainer.send, chunk), partial(lambda c: httpx.post(
                f"{admin}/update_weights", timeout=TIMEOUT_S,
                json={"update_info": GlooTrainer.update_info(c)}), chunk))
            assert reply.status_code == 200, reply.text
        reply = httpx.post(f"{admin}/finish_weight_update", timeout=TIMEOUT_S,
                           json={"weight_version": PUSHED})
        assert reply.status_code == 200, reply.text
    finally:
        httpx.post(f"{admin}/shutdown_weight_transfer_engine", timeout=60)
        trainer.close()

    served = fleet.served()
    after = [_complete(server, r["prompt_token_ids"], r["max_tokens"])
             for r in requests for _ in range(4)]  # four each: both processes answer
    assert [tokens for tokens, _ in after] == [t for t in expected for _ in range(4)]
    assert {fingerprint for _, fingerprint in after} == {PUSHED}
    assert fleet.version() == PUSHED  # process 0 admits under it too
    assert all(now > then for now, then in zip(fleet.served(), served, strict=True))


@dataclass
class Load:
    """``LOAD_STREAMS`` threads, each streaming the requests one after another (in turn)
    until stopped; every response, with when it was sent."""

    base_url: str
    requests: list[dict[str, Any]]
    results: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for n in range(LOAD_STREAMS):
            self._threads.append(threading.Thread(target=self._run, args=(n,), daemon=True))
            self._threads[-1].start()

    def _run(self, n: int) -> None:
        i = n
        while not self._stop.is_set():
            got: list[dict[str, Any]] = []
            sent = time.monotonic()
            index = i % len(self.requests)
            stream(self.base_url, self.requests[index], index, got)
            self.results.append({**got[0], "sent": sent})
            i += 1

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in self._threads), "a stream never ended"
        return self.results


def _spans(got: dict[str, Any]) -> list[tuple[str, int, int]]:
    usage = got["usage"] or {}
    return [(s["version"], s["start"], s["end"]) for s in usage.get("weight_versions", [])]


@pytest.mark.parametrize("policy", ["drain", "abort", "keep"])
def test_a_refit_through_one_process_holds_for_both(
        on_original: Fleet, checkpoints: Checkpoints, policy: str) -> None:
    fleet, refs = on_original, checkpoints.refs
    served = fleet.served()
    reruns = sum(router_metric(a, "pdserve:weight_update_reruns_total") for a in fleet.admins)
    load = Load(fleet.server.base_url, checkpoints.requests)
    load.start()
    try:  # streams run through both processes (the kernel picks one per connection)
        both = wait_until(lambda: all(now > then for now, then in
                                      zip(fleet.served(), served, strict=True)), 120, 0.2)
    except BaseException:
        load.stop()
        raise
    r = update(fleet.admin, checkpoints.perturbed, PERTURBED, policy)
    returned = time.monotonic()
    time.sleep(1.0)  # requests sent after the call returned
    results = load.stop()
    assert both, "every stream reached the same router process"
    assert r.status_code == 200, r.text
    switched = cut = 0
    for got in results:
        assert got.get("status") == 200 and "error" not in got, (
            got.get("status"), got.get("error"), got["sent"] - returned)
        tokens, spans, want = got["tokens"], _spans(got), checkpoints.requests[got["prompt"]]
        assert spans and spans[0][1] == 0 and spans[-1][2] == len(tokens), got
        if got["sent"] > returned:
            assert [v for v, _, _ in spans] == [PERTURBED], got
        if len(spans) == 2:  # a kept request: the old weights', then the new weights'
            assert policy == "keep" and [v for v, _, _ in spans] == [ORIGINAL, PERTURBED], got
            k = spans[0][2]
            assert tokens[:k] == refs[ORIGINAL][got["prompt"]][:k], got
            rest, _ = _complete(fleet.server, want["prompt_token_ids"] + tokens[:k],
                                want["max_tokens"] - k)
            assert tokens[k:] == rest, got
            switched += 1
            continue
        (version, _, _), = spans
        assert got["fingerprints"] == {version} and got["header"] == version, got
        expected = refs[version][got["prompt"]]
        assert tokens == expected[:len(tokens)], (version, got, expected)
        if got["finish"] == "abort":
            assert policy == "abort", got
            cut += 1
        else:
            assert tokens == expected, (version, got, expected)
    reruns = sum(router_metric(a, "pdserve:weight_update_reruns_total")
                 for a in fleet.admins) - reruns
    if policy == "abort":
        assert cut + reruns >= 1, results
    elif policy == "keep":
        assert switched >= 1, results
    else:
        assert cut == reruns == 0, results
    assert fleet.version() == PERTURBED
    assert wait_until(lambda: _idle(fleet), 20), "the worker holds requests or KV"


def _idle(fleet: Fleet) -> bool:
    """No request, call or KV block held on the worker (its next probe says so)."""
    view = httpx.get(fleet.server.base_url.removesuffix("/v1") + "/workers", timeout=10)
    return all(w["load"]["num_running_reqs"] == w["load"]["num_waiting_reqs"] == 0
               and w["load"]["num_inflight_reqs"] == 0 and w["load"]["kv_cache_usage"] == 0
               for w in view.json()["workers"])
