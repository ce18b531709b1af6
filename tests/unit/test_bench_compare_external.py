"""``pdserve bench compare --vllm-url``: the baseline is a vLLM server already running.
Its spec has no process; bad URLs, nothing listening and a model it does not serve are
one error line before anything starts; compare runs the baseline's unloaded run and rate
runs against it, never starts or signals a process for it, leaves it serving, and the
report says it was external."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.bench.compare import main as compare
from pdserve.bench.compare.config import CompareConfig
from pdserve.bench.compare.external import ExternalVllm, base_url, check_external
from pdserve.bench.compare.report import CompareReport, render_markdown
from pdserve.bench.compare.systems import EngineSettings, vllm_external
from pdserve.cli import bench as bench_cli
from pdserve.cli import bench_flags
from pdserve.core import process
from pdserve.core.dtype import resolve_dtype
from pdserve.core.model import resolve_model
from pdserve.core.ports import free_port

SETTINGS = EngineSettings("/models/m", "m", "float32", 1, 512, (0,))


class FakeVllm(BaseHTTPRequestHandler):
    """``/v1/models`` (the server's ``served`` ids) and a chat completion; counts requests."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path != "/v1/models":
            self._reply(404, {"error": "no"})
            return
        served: list[str] = self.server.served  # type: ignore[attr-defined]
        self._reply(200, {"object": "list", "data": [
            {"id": name, "object": "model", "root": f"/models/{name}", "max_model_len": 4096}
            for name in served]})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.chats += 1  # type: ignore[attr-defined]
        self._reply(200, {"choices": [{"message": {"role": "assistant", "content": "hi"}}]})

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return None


def _serve(served: list[str]) -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    server.served = served  # type: ignore[attr-defined]
    server.chats = 0  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def fake_vllm() -> Iterator[ThreadingHTTPServer]:
    """A server that serves the default model's name (``--model``'s default) and ``m``."""
    yield from _serve([resolve_model(None).served_name, SETTINGS.served_name])


@pytest.fixture
def other_vllm() -> Iterator[ThreadingHTTPServer]:
    yield from _serve(["other-model", "another"])


def test_the_url_is_taken_with_or_without_v1_and_a_bad_one_refused() -> None:
    assert base_url("http://10.0.0.5:8000/v1/") == "http://10.0.0.5:8000"
    assert base_url(" https://vllm.example ") == "https://vllm.example"
    for bad in ("ftp://h:1", "127.0.0.1:8000", "http://:8000", "http://h:99999"):
        with pytest.raises(ValueError, match="--vllm-url"):
            base_url(bad)


def test_the_external_baseline_replaces_vllm_tuned_and_has_no_process() -> None:
    ext = ExternalVllm("http://10.0.0.5:8000", {"id": "m", "max_model_len": 4096})
    spec = vllm_external(ext.url, 8000, ext.card)
    assert (spec.name, spec.kind, spec.procs, spec.external) == (
        "vllm-external", "vllm-external", (), True)
    assert spec.base_url == "http://10.0.0.5:8000"
    as_json = spec.to_json()
    assert (as_json["external"], as_json["url"], as_json["card"]) == (
        True, "http://10.0.0.5:8000", {"id": "m", "max_model_len": 4096})

    cfg = _config(Path("out"), ext, with_vllm_stock=True)
    systems = compare.build_systems(cfg)
    assert [(s.name, s.external) for s in systems] == [
        ("vllm-external", True), ("vllm", False), ("default", False)]
    assert compare.baseline_of(cfg) == "vllm-external"
    assert compare.baseline_of(_config(Path("out"), None)) == "vllm-tuned"
    assert compare.build_systems(_config(Path("out"), None))[0].name == "vllm-tuned"


@pytest.mark.parametrize(("argv", "message"), [
    (["--vllm-url", "ftp://x:1"], "expected http(s)://HOST:PORT"),
    (["--vllm-url", "http://127.0.0.1:1", "--no-vllm"], "pick one"),
    (["--pdserve", "vllm-external="], "must differ"),
])
def test_bad_vllm_url_input_is_one_error_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
        message: str) -> None:
    _assert_refused(tmp_path, capsys, argv, message)


def test_nothing_listening_is_an_error_after_the_startup_timeout(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    _assert_refused(tmp_path, capsys, ["--vllm-url", url, "--startup-timeout-s", "1.5"],
                    "/v1/models did not answer within --startup-timeout-s 1.5 (ConnectError")


def test_a_server_not_serving_the_model_is_an_error_naming_what_it_serves(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        other_vllm: ThreadingHTTPServer) -> None:
    _assert_refused(tmp_path, capsys, ["--vllm-url", _url(other_vllm)],
                    f"serves 'other-model', 'another', not "
                    f"'{resolve_model(None).served_name}'")


def test_a_server_serving_the_model_is_accepted_with_its_card(
        tmp_path: Path, fake_vllm: ThreadingHTTPServer) -> None:
    args = bench_cli.build_parser().parse_args([
        "compare", "--vllm-url", f"{_url(fake_vllm)}/v1", "--output-dir",
        str(tmp_path / "out")])
    cfg = bench_flags.compare_config(args)
    assert cfg.vllm_external is not None and cfg.vllm_external.url == _url(fake_vllm)
    assert cfg.vllm_external.card["max_model_len"] == 4096
    assert compare.settings_json(cfg)["vllm_url"] == _url(fake_vllm)
    with pytest.raises(ValueError, match="serves"):
        check_external(_url(fake_vllm), "not-it", 1.0)


def test_compare_runs_against_the_external_baseline_and_never_starts_or_signals_it(
        tmp_path: Path, fake_vllm: ThreadingHTTPServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole of ``run_compare`` with one system, the external baseline: its unloaded
    run and rate run go to its URL; no process is spawned or stopped, no signal sent; the
    server still answers after; the report says it was external."""
    calls: list[str] = []

    def forbidden(name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> None:
            calls.append(name)
            raise AssertionError(f"compare called {name} for an external baseline")
        return record

    for name in ("spawn", "stop", "signal_group"):
        monkeypatch.setattr(process, name, forbidden(f"process.{name}"))
    monkeypatch.setattr(os, "kill", forbidden("os.kill"))
    monkeypatch.setattr(os, "killpg", forbidden("os.killpg"))
    runs: list[list[str]] = []

    def fake_run_bench(argv: list[str], out: Path, timeout_s: float
                       ) -> tuple[dict[str, Any] | None, str | None]:
        runs.append(argv)
        return _result(), None

    monkeypatch.setattr(compare, "run_bench", fake_run_bench)
    written: list[CompareReport] = []
    cfg = _config(tmp_path / "out", check_external(_url(fake_vllm), SETTINGS.served_name, 5),
                  pdserve=())
    report = compare.run_compare(cfg, lambda r, folder: written.append(r))
    assert calls == []
    assert len(runs) == 2  # the unloaded run, then the one rate
    assert all(a[a.index("--base-url") + 1] == _url(fake_vllm) for a in runs)
    assert fake_vllm.chats == 1  # type: ignore[attr-defined]  # the warm request
    assert httpx.get(f"{_url(fake_vllm)}/v1/models", timeout=5).status_code == 200

    (system,) = report.systems
    assert (report.baseline, system.name, system.kind) == (
        "vllm-external", "vllm-external", "vllm-external")
    assert system.error is None and system.unloaded is not None
    assert system.stop == {"clean": True, "killed": [], "left_behind": [],
                           "port_free": None, "external": True}
    assert report.derived_slo == {"ttft_s": pytest.approx(0.6), "tpot_s": pytest.approx(0.1)}
    assert report.settings["vllm_url"] == _url(fake_vllm)
    md = render_markdown(report)
    assert f"`vllm-external` is external: the vLLM server already running at {_url(fake_vllm)}"\
        in md
    assert "operator's, not compare's" in md and "max_model_len 4096" in md
    assert "| not stopped (external) |" in md
    assert (tmp_path / "out").is_dir()


def _assert_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                    message: str) -> None:
    out = tmp_path / "report"
    assert bench_cli.main(["compare", *argv, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pdserve bench: error: "), err
    assert message in err[0]
    assert list(tmp_path.iterdir()) == []


def _config(out: Path, ext: ExternalVllm | None, with_vllm_stock: bool = False,
            pdserve: tuple[tuple[str, str], ...] = (("default", ""),)) -> CompareConfig:
    return CompareConfig(
        SETTINGS, (1.0,), pdserve, True, False, ("--seed", "0"), 0, None, out, 5.0, 60.0,
        5.0, resolve_dtype("float32"), with_vllm_stock, vllm_external=ext)


def _result() -> dict[str, Any]:
    """A ``pdserve.bench.run/v1`` result: TTFT p50 0.2 s, ITL p50 50 ms."""
    requests = [{"ttft_s": 0.2, "tpot_s": 0.05, "error": None}]
    return {"schema": "pdserve.bench.run/v1", "num_requests": 1, "completed": 1,
            "failed": 0, "request_throughput": 1.0, "ttft_s": {"p50": 0.2},
            "itl_s": {"p50": 0.05}, "requests": requests}
