"""Fixtures for integration tests: the shared ``pdserve up`` clusters (``pd_server``:
router, prefill and decode vLLM engines; ``clusters.py``), one at a time, each kept
while consecutive tests ask for it; one aggregated ``vllm serve`` and the reference
runs, the oracles."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from integration.clusters import STARTUP_TIMEOUT_S, TCP, ClusterSlot, PdCluster, wanted
from integration.lora_oracle import LoraOracle
from integration.oracles import EngineRuns, Run, reference_requests, served_run
from integration.pd_cases import CASES, MODEL
from integration.refits import Checkpoints, PerturbedOracle
from pdserve_testing import Server, kill_cluster, launch_up

from pdserve.core import process
from pdserve.core.certs import make_test_ca
from pdserve.core.dtype import resolve_dtype
from pdserve.core.model import prepare_default_model
from pdserve.core.ports import free_port
from pdserve.worker.engine_tmp import vllm_tmp_env


@pytest.fixture(scope="session")
def model_path() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_path: Path) -> Any:
    from pdserve.core.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def engine_runs(model_path: Path, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[EngineRuns]:
    """The reference runs in dtypes other than float32, one engine run each."""
    runs = EngineRuns(model_path, reference_requests(tokenizer),
                      lambda dtype: tmp_path_factory.mktemp(f"reference-{dtype}"))
    try:
        yield runs
    finally:
        runs.close()


@pytest.fixture(scope="session")
def reference_engine_runs(vllm_openai: str, engine_runs: EngineRuns) -> Callable[[str], Run]:
    """Aggregated vLLM's greedy output for each of CASES, then KILL_CASE, in a dtype, with
    each position's top-5 logprobs (``oracles.py``): float32 from the session's ``vllm
    serve``, another dtype from one engine run of its own; each computed once."""
    served: list[Run] = []

    def run(dtype: str) -> Run:
        if dtype != "float32":
            return engine_runs.get(dtype)
        if not served:
            served.append(served_run(vllm_openai, engine_runs.requests))
        return served[0]

    return run


@pytest.fixture(scope="session")
def reference_runs(reference_engine_runs: Callable[[str], Run]
                   ) -> Callable[[str], list[list[int]]]:
    """The reference token ids in a dtype."""
    return lambda dtype: reference_engine_runs(dtype)[0]


@pytest.fixture(scope="session")
def references(reference_runs: Callable[[str], list[list[int]]]) -> list[list[int]]:
    """The float32 ones: the exact-equality oracle."""
    return reference_runs("float32")


@pytest.fixture(scope="session")
def reference(references: list[list[int]]) -> list[list[int]]:
    return references[: len(CASES)]


@pytest.fixture(scope="session")
def perturbed_oracle(model_path: Path, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[PerturbedOracle]:
    oracle = PerturbedOracle(model_path, tokenizer, tmp_path_factory.mktemp("weights"))
    try:
        yield oracle
    finally:
        oracle.close()


@pytest.fixture(scope="session")
def lora_oracle(model_path: Path, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[LoraOracle]:
    """``test_lora_pd.py``'s adapters and their one engine (``lora_oracle.py``)."""
    oracle = LoraOracle(model_path, tokenizer, tmp_path_factory.mktemp("lora-oracle"))
    try:
        yield oracle
    finally:
        oracle.close()


@pytest.fixture(scope="session")
def checkpoints(perturbed_oracle: PerturbedOracle, references: list[list[int]]) -> Checkpoints:
    """The perturbed checkpoint and both versions' greedy tokens (``refits.py``), for every
    module that refits: its reference engine runs once."""
    return perturbed_oracle.get(references)


_SLOT = ClusterSlot()


@pytest.fixture
def pd_server(model_path: Path, request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Server:
    """The P/D cluster ``TCP``, or the ``PdCluster`` a test parametrizes it with
    (``indirect=True``): the running one when the test before asked for the same one."""

    def start(cluster: PdCluster) -> Server:
        env = dict(os.environ, HF_HUB_OFFLINE="1",
                   PDSERVE_CACHE=os.environ.get("PDSERVE_CACHE", str(model_path.parents[1])))
        folder = tmp_path_factory.mktemp(f"up-{cluster.name}")
        tls = make_test_ca(folder / "tls") if cluster.require_tls else None
        admin_port = free_port()  # the router's admin listener (loopback, no key)
        server = launch_up([*cluster.argv(free_port(), tls), "--admin-port", str(admin_port)],
                           env, STARTUP_TIMEOUT_S, log_path=folder / "up.log")
        return replace(server, admin_url=f"http://127.0.0.1:{admin_port}")

    return _SLOT.get(getattr(request, "param", TCP), start)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After a test, once its fixtures are down: the running cluster is killed unless
    the next test asks for it."""
    if wanted(nextitem) != _SLOT.cluster:
        _SLOT.stop()


def pytest_sessionfinish() -> None:
    _SLOT.stop()  # an interrupted session too


@pytest.fixture(scope="session")
def vllm_process(model_path: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """The ``vllm serve`` behind ``vllm_openai``, spawned, not waited for: the process,
    its URL and its log."""
    port = free_port()
    folder = tmp_path_factory.mktemp("vllm-serve")
    log = folder / "vllm.log"
    # its ZMQ IPC sockets and its executor's rendezvous file (file://$TMPDIR/vllm_dist_*)
    # in the test's folder, not left in /tmp (as pdserve's engines do)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               **vllm_tmp_env(folder))
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(model_path), "--served-model-name", MODEL, "--dtype", "float32",
            "--max-model-len", "4096", "--enforce-eager", "--host", "127.0.0.1", "--port",
            str(port), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    proc = process.spawn(argv, log_path=log, base_env=env)
    try:
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        kill_cluster(proc)


@pytest.fixture(scope="session", autouse=True)
def _early_oracles(request: pytest.FixtureRequest) -> None:
    """At the first integration test, start every oracle later tests will use (the ``vllm
    serve``; the one-shot engine runs: other dtypes, the perturbed checkpoint, the LoRA
    adapters): their engines load side by side, each loading while the others do, and
    the runs are done before the tests that read them. (Never one beside engines that
    serve a test: on two cores an engine starting beside one that computes stalled it
    for 97 s once.) Started at their modules instead, the perturbed run loaded alone
    (45 s) and the LoRA run made a third engine beside its cluster's two."""
    items = request.session.items

    def used(fixture: str) -> bool:
        return any(fixture in getattr(item, "fixturenames", ()) for item in items)

    if used("vllm_openai"):
        request.getfixturevalue("vllm_process")
    if used("checkpoints"):
        request.getfixturevalue("perturbed_oracle").start()
    if used("lora_oracle"):
        request.getfixturevalue("lora_oracle").start()
    dtypes = {resolve_dtype(cluster.dtype).dtype for item in items
              if "reference_engine_runs" in getattr(item, "fixturenames", ())
              and (cluster := wanted(item)) is not None} - {"float32"}
    for dtype in sorted(dtypes):
        request.getfixturevalue("engine_runs").start(dtype)


@pytest.fixture(scope="session")
def vllm_openai(vllm_process: tuple[subprocess.Popen[bytes], str, Path]) -> str:
    """One aggregated ``vllm serve`` (vLLM's own OpenAI server) of the model, float32,
    with the hermes tool parser: the reference for the OpenAI surface. Its base URL
    (``.../v1``, as ``Server.base_url``), once it answers."""
    proc, url, log = vllm_process

    def exited() -> str | None:
        return None if proc.poll() is None else f"vllm serve: {log.read_text()[-2000:]}"

    process.wait_ready(lambda: "" if _healthy(url) else "no /health yet", STARTUP_TIMEOUT_S,
                       exited=exited, interval_s=1.0)
    return f"{url}/v1"


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
