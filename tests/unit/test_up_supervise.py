"""``pdserve up`` supervising its children, on simulated workers (``--simulated``; no
vLLM): a SIGKILLed decode worker is restarted on its port and rejoins the router's
view while requests keep succeeding on the other; stopping leaves no process."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from pdserve_testing import launch_up, stop_up, wait_until

from pdserve.cli.configs import up_config
from pdserve.cli.parser import build_parser
from pdserve.core.model import ResolvedModel
from pdserve.core.ports import free_port
from pdserve.launch.up import plan, run_log_dir

# The router imports transformers for its tokenizer: ~20 s on two busy cores.
STARTUP_TIMEOUT_S = 90


def test_up_flags_reach_the_config_and_simulated_plans_sim_workers(tmp_path: Path) -> None:
    args = build_parser().parse_args(["up", "--simulated", "--num-decode", "2",
                                      "--max-restarts", "2", "--restart-window-s", "30"])
    cfg = up_config(args, ResolvedModel(Path("/m"), "m"))
    assert (cfg.simulated, cfg.max_restarts, cfg.restart_window_s) == (True, 2, 30.0)
    assert cfg.restart_policy.max_restarts == 2 and cfg.restart_policy.window_s == 30.0
    children = {c.name: c.argv for c in plan(cfg, tmp_path)}
    assert set(children) == {"prefill-0", "decode-0", "decode-1", "router"}
    for name in ("prefill-0", "decode-0", "decode-1"):
        argv = children[name]
        i = argv.index("sim-worker")
        assert argv[i + 1:i + 3] == ["--role", name.split("-")[0]]
        assert argv[argv.index("--worker-id") + 1] == name
        assert "--kv-port" not in argv and "--cpu-cores" not in argv
    assert "sim-worker" not in " ".join(children["router"])


@dataclass
class Outcome:
    started: float
    ok: bool
    detail: str


def _client_loop(base_url: str, stop: threading.Event, outcomes: list[Outcome]) -> None:
    """Sequential completions until ``stop``; each one's start time and result."""
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            started = time.monotonic()
            try:
                reply = client.post(base_url + "/completions", json={
                    "model": "SmolLM2-135M-Instruct", "prompt": "Count: one two three",
                    "max_tokens": 8})
                ok = reply.status_code == 200 and bool(reply.json()["choices"][0]["text"])
                outcomes.append(Outcome(started, ok, reply.text[:200]))
            except httpx.HTTPError as exc:
                outcomes.append(Outcome(started, False, repr(exc)))
            time.sleep(0.02)


def _worker_proc(up_pid: int, worker_id: str) -> psutil.Process | None:
    for p in psutil.Process(up_pid).children(recursive=True):
        try:
            argv = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "--worker-id" in argv and argv[argv.index("--worker-id") + 1] == worker_id:
            return p
    return None


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _healthy(base_url: str, worker_id: str) -> bool:
    view = httpx.get(base_url.removesuffix("/v1") + "/workers", timeout=5).json()
    return any(w["id"] == worker_id and w["healthy"] for w in view["workers"])


def test_sigkilled_decode_is_restarted_and_rejoins_while_requests_keep_succeeding(
    tmp_path: Path,
) -> None:
    env = dict(os.environ, PDSERVE_LOG_LEVEL="WARNING")
    server = launch_up(["--simulated", "--num-decode", "2", "--port", str(free_port()),
                        "--startup-timeout-s", str(STARTUP_TIMEOUT_S)], env,
                       STARTUP_TIMEOUT_S, log_path=tmp_path / "up.log")
    stop, outcomes = threading.Event(), []  # type: ignore[var-annotated]
    client = threading.Thread(target=_client_loop, args=(server.base_url, stop, outcomes))
    try:
        victim = _worker_proc(server.proc.pid, "decode-1")
        assert victim is not None
        endpoint = victim.cmdline()[victim.cmdline().index("--port") + 1]
        client.start()
        assert wait_until(lambda: len(outcomes) >= 5, timeout_s=20)
        killed = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        # The router sees it gone (a refused connection), then healthy again.
        assert wait_until(lambda: not _healthy(server.base_url, "decode-1"), timeout_s=10)
        assert wait_until(lambda: _healthy(server.base_url, "decode-1"), timeout_s=40), \
            server.log_lines("decode-1")
        back = _worker_proc(server.proc.pid, "decode-1")
        assert back is not None and back.pid != victim.pid
        assert back.cmdline()[back.cmdline().index("--port") + 1] == endpoint  # same port
        assert wait_until(lambda: server.log_lines("decode-1 is back (restart 1)"),
                          timeout_s=10)
        time.sleep(1)
    finally:
        stop.set()
        client.join(15)
        up = psutil.Process(server.proc.pid)
        tree = [up, *up.children(recursive=True)]
        stopped = stop_up(server.proc)
    after = [o for o in outcomes if o.started > killed]
    failed = [o.detail for o in after if not o.ok]
    # Only a request in flight on decode-1 when it died may fail; every later one
    # goes to decode-0 (or to decode-1 once it is back).
    assert len(after) >= 10 and not failed, failed
    assert server.proc.returncode == 0
    left = [p.pid for p in tree if _alive(p)]
    assert not left, "processes left after stopping pdserve up"
    assert server.temp_dir is not None and not server.temp_dir.exists()
    # every process logged into the folder launch_up gave up's --log-dir
    assert server.log_dir is not None and server.log_dir.parent == tmp_path
    assert {p.name for p in server.log_dir.iterdir()} >= {
        "router.log", "prefill-0.log", "decode-0.log", "decode-1.log"}
    # up stopped its own children within the grace: nothing needed the SIGKILL
    assert stopped.clean, stopped.killed


@pytest.mark.parametrize("flag", ["--max-restarts", "--restart-window-s"])
def test_bad_restart_flags_are_one_line_errors(flag: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", flag, "-1"])


def test_each_up_gets_its_own_log_folder_unless_told_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ups started in one second once shared a folder named by the second."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    first, second = run_log_dir(""), run_log_dir("")
    assert first != second and first.parent == second.parent == tmp_path / "cache" / "logs"
    chosen = run_log_dir(str(tmp_path / "mine" / "logs"))
    assert chosen == tmp_path / "mine" / "logs" and chosen.is_dir()
    args = build_parser().parse_args(["up", "--simulated", "--log-dir", str(chosen)])
    assert up_config(args, ResolvedModel(Path("/m"), "m")).log_dir == str(chosen)
