"""Session fixtures for integration tests: one real ``pdserve up`` (router +
prefill + decode vLLM engines) shared by every test in the session."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from integration.pd_cases import CASES, KILL_CASE, prompt_ids
from pdserve_testing import Server

from pdserve.model import prepare_default_model
from pdserve.up import free_port

STARTUP_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def model_path() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def references(model_path: Path, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
               ) -> list[list[int]]:
    """Aggregated vLLM's greedy output for each of CASES, then KILL_CASE (one engine run)."""
    tmp = tmp_path_factory.mktemp("reference")
    requests = [{"prompt_token_ids": prompt_ids(tokenizer, c), "max_tokens": c.max_tokens}
                for c in [*CASES, KILL_CASE]]
    (tmp / "in.json").write_text(json.dumps(requests))
    script = Path(__file__).with_name("reference_engine.py")
    subprocess.run([sys.executable, str(script), str(model_path), str(tmp / "in.json"),
                    str(tmp / "out.json")], check=True, timeout=600,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((tmp / "out.json").read_text())


@pytest.fixture(scope="session")
def reference(references: list[list[int]]) -> list[list[int]]:
    return references[: len(CASES)]


@pytest.fixture(scope="session")
def pd_server(model_path: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    """The P/D cluster, over ``--transport tcp`` unless a test parametrizes it
    indirectly with ``"<transport>"`` or ``"<transport>:<MiB/s>"`` (KV sends paced
    by ``--kv-throttle-mib-s``). One cluster at a time: pytest tears the previous
    one down first. Transfers are checksummed."""
    transport, _, throttle = str(getattr(request, "param", "tcp")).partition(":")
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PDSERVE_CACHE=os.environ.get("PDSERVE_CACHE", str(model_path.parents[1])))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--dtype", "float32", "--port", str(port),
         "--kv-cache-gib", "1", "--max-model-len", "4096", "--transport", transport,
         "--kv-checksum", "--kv-push", "--kv-throttle-mib-s", throttle or "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        start_new_session=True,
    )
    try:
        url = _wait_for_url(proc)
        yield Server(url, proc)
    finally:
        _stop(proc)


def _wait_for_url(proc: subprocess.Popen[str]) -> str:
    """The endpoint line ``pdserve up`` prints once everything is healthy."""
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"pdserve up exited with {proc.returncode} during startup") from None
            continue
        if line.startswith("http://"):
            return line.strip()
    raise TimeoutError(f"pdserve up not ready after {STARTUP_TIMEOUT_S}s")


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
