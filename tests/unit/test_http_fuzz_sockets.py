"""HTTP fuzzing through real sockets (issue 40): ``pdserve up`` runs the router under its
real uvicorn (main port and admin port, the express lane, the pipelining protocol), and
each port is fuzzed from its own ``/openapi.json`` (Schemathesis), with raw bodies and
with junk no client library sends (``socket_fuzz.py``), without keys and with them
(client keys on the main port, an admin key on the admin port: right, wrong and none in
turn). No answer is a 5xx, every refusal on an OpenAI route is OpenAI error JSON, and
afterwards nothing is held: the router's in-flight gauges are back to 0, the workers
hold no request, lease or pending transfer, and a request is served.

Simulated workers (``up --simulated``: real gRPC, made-up tokens) take the long fuzz
here; a shorter one runs on real vLLM engines (float32) through the admin plane's keyed
router on the shared ``TCP`` cluster (``test_pd_e2e_tls_admin_plane.py``) and checks
their KV cache is empty afterwards. Which routes exist is read from each port's openapi,
not written here; the run and the checks are ``http_fuzz.py``'s. Each port's tally is
printed (``-s`` shows it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from integration.http_fuzz import WRONG_KEY, Cluster, check_after_fuzz, fuzz_port
from integration.socket_fuzz import TIMEOUT_S, Port
from pdserve_testing import kill_cluster, launch_up

from pdserve.core.ports import free_port

CLIENT_KEY, TENANT_KEY, ADMIN_KEY = "fuzz-client-key-1", "fuzz-client-key-2", "fuzz-admin-key"
SIM_STARTUP_S = 300  # the router imports transformers: ~20 s on idle cores, minutes on busy
NUM_SCHEMA = 100  # per port, over its operations
NUM_RAW = 50  # per port


def _admin_key_args(tmp_path: Path, key: str) -> list[str]:
    path = tmp_path / "admin-key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return ["--admin-key-file", str(path)]


def _start(tmp_path: Path, keyed: bool, extra: list[str], startup_s: float) -> Cluster:
    port, admin_port = free_port(), free_port()
    args = [*extra, "--port", str(port), "--admin-port", str(admin_port)]
    if keyed:
        args += ["--api-key", CLIENT_KEY, "--api-key", TENANT_KEY,
                 *_admin_key_args(tmp_path, ADMIN_KEY)]
    env = dict(os.environ, PDSERVE_LOG_LEVEL="WARNING")
    server = launch_up(args, env, startup_s, log_path=tmp_path / "up.log")
    label = "keys" if keyed else "open"
    main = Port(f"main/{label}", f"http://127.0.0.1:{port}", True,
                (CLIENT_KEY, WRONG_KEY, None, TENANT_KEY) if keyed else (None,))
    admin = Port(f"admin/{label}", f"http://127.0.0.1:{admin_port}", False,
                 (ADMIN_KEY, WRONG_KEY, None, CLIENT_KEY) if keyed else (None,))
    models = httpx.get(main.url + "/v1/models", headers=main.headers(0), timeout=TIMEOUT_S)
    return Cluster(server, main, admin, models.json()["data"][0]["id"])


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Cluster]]:
    """Both simulated clusters, without keys and with them, started at once (each start
    is mostly one core importing), by label."""
    args = ["--simulated", "--startup-timeout-s", str(SIM_STARTUP_S)]
    with ThreadPoolExecutor(2) as pool:
        starting = {label: pool.submit(_start, tmp_path_factory.mktemp(f"fuzz-sim-{label}"),
                                       keyed, args, SIM_STARTUP_S)
                    for label, keyed in (("open", False), ("keys", True))}
    clusters = {label: f.result() for label, f in starting.items() if f.exception() is None}
    try:
        for future in starting.values():
            future.result()  # raises the first start's failure (after the pool's end)
        yield clusters
    finally:
        for cluster in clusters.values():
            kill_cluster(cluster.server.proc)


@pytest.fixture(params=["open", "keys"])
def sim(request: pytest.FixtureRequest, sims: dict[str, Cluster]) -> Cluster:
    return sims[request.param]


def test_fuzz_on_simulated_workers_finds_no_5xx_and_leaves_nothing_held(sim: Cluster) -> None:
    tallies = [(port, fuzz_port(sim, port, NUM_SCHEMA, NUM_RAW))
               for port in (sim.main, sim.admin)]
    check_after_fuzz(sim, tallies, cache_too=False)  # a simulated prefix cache stays full
