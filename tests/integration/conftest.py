"""Session fixtures for integration tests: one real ``pdserve up`` (router +
prefill + decode vLLM engines) shared by every test in the session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from integration.pd_cases import (
    CASES,
    KILL_CASE,
    LOCAL_PREFILL_MAX_TOKENS,
    MODEL,
    TopLogprobs,
    prompt_ids,
)
from pdserve_testing import Server, launch_up, stop_up

from pdserve.core import process
from pdserve.core.model import prepare_default_model
from pdserve.core.ports import free_port

STARTUP_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def model_path() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def reference_engine_runs(model_path: Path, tokenizer: Any,
                          tmp_path_factory: pytest.TempPathFactory
                          ) -> Callable[[str], tuple[list[list[int]], list[list[TopLogprobs]]]]:
    """Aggregated vLLM's greedy output for each of CASES, then KILL_CASE, in a dtype, with
    each position's top-5 logprobs (one engine run per dtype, the first time it is asked
    for)."""
    runs: dict[str, tuple[list[list[int]], list[list[TopLogprobs]]]] = {}

    def run(dtype: str) -> tuple[list[list[int]], list[list[TopLogprobs]]]:
        if dtype not in runs:
            tmp = tmp_path_factory.mktemp(f"reference-{dtype}")
            requests = [{"prompt_token_ids": prompt_ids(tokenizer, c),
                         "max_tokens": c.max_tokens} for c in [*CASES, KILL_CASE]]
            (tmp / "in.json").write_text(json.dumps(requests))
            script = Path(__file__).with_name("reference_engine.py")
            subprocess.run([sys.executable, str(script), str(model_path), str(tmp / "in.json"),
                            str(tmp / "out.json"), dtype], check=True, timeout=600,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            tops = json.loads((tmp / "out.json.top.json").read_text())
            runs[dtype] = (json.loads((tmp / "out.json").read_text()),
                           [[{int(t): lp for t, lp in pos.items()} for pos in req]
                            for req in tops])
        return runs[dtype]

    return run


@pytest.fixture(scope="session")
def reference_runs(reference_engine_runs: Callable[[str], tuple[list[list[int]], Any]]
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
def pd_server(model_path: Path, request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The P/D cluster, over ``--transport tcp`` unless a test parametrizes it
    indirectly with ``"<transport>[:<MiB/s>[:<disagg>[:<dtype>]]]"`` (KV sends paced
    by ``--kv-throttle-mib-s``; dtype float32 unless given, e.g. ``auto``). The tcp
    cluster runs ``--disagg auto`` (CASES' short prompts on decode alone, the long ones
    P → D); the others ``--disagg always``: they test their transport on every case.
    One cluster at a time: pytest tears the previous one down first. Transfers are
    checksummed."""
    transport, _, rest = str(getattr(request, "param", "tcp")).partition(":")
    throttle, _, rest = rest.partition(":")
    disagg, _, dtype = rest.partition(":")
    disagg = disagg or ("auto" if transport == "tcp" else "always")
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PDSERVE_CACHE=os.environ.get("PDSERVE_CACHE", str(model_path.parents[1])))
    server = launch_up(
        ["--dtype", dtype or "float32", "--port", str(free_port()), "--kv-cache-gib", "1",
         "--max-model-len", "4096", "--transport", transport, "--kv-checksum", "--kv-push",
         "--kv-throttle-mib-s", throttle or "0", "--disagg", disagg,
         "--local-prefill-max-tokens", str(LOCAL_PREFILL_MAX_TOKENS),
         "--tool-call-parser", "hermes", "--enable-auto-tool-choice"], env, STARTUP_TIMEOUT_S,
        log_path=tmp_path_factory.mktemp(f"up-{transport}") / "up.log")
    try:
        yield server
    finally:
        stop_up(server.proc)


@pytest.fixture(scope="session")
def vllm_openai(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One aggregated ``vllm serve`` (vLLM's own OpenAI server) of the model, float32,
    with the hermes tool parser: the reference for the OpenAI surface. Its base URL
    (``.../v1``, as ``Server.base_url``)."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-serve") / "vllm.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(model_path), "--served-model-name", MODEL, "--dtype", "float32",
            "--max-model-len", "4096", "--enforce-eager", "--host", "127.0.0.1", "--port",
            str(port), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    proc = process.spawn(argv, log_path=log, base_env=env)
    url = f"http://127.0.0.1:{port}"

    def exited() -> str | None:
        return None if proc.poll() is None else f"vllm serve: {log.read_text()[-2000:]}"

    try:
        process.wait_ready(lambda: "" if _healthy(url) else "no /health yet", STARTUP_TIMEOUT_S,
                           exited=exited, interval_s=1.0)
        yield f"{url}/v1"
    finally:
        stop_up(proc)


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
