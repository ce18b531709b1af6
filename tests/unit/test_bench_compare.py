"""``pdserve bench compare`` without engines: the report from constructed run JSONs
(ratios in the Markdown, valid PNGs), the systems' command lines (the same engine
settings everywhere), bad input (one error line, nothing written), and a SIGTERM
while a real ``pdserve up --simulated`` serves (stopped, nothing left, no report)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import matplotlib.image
import numpy as np
import psutil
import pytest

from pdserve.bench.compare import main as compare
from pdserve.bench.compare.launch import port_free
from pdserve.bench.compare.plots import write_report
from pdserve.bench.compare.report import CompareReport, RateRun, SystemResult
from pdserve.bench.compare.systems import (
    EngineSettings,
    parse_pdserve_entry,
    pdserve_up,
    vllm_aggregated,
    vllm_disagg,
)
from pdserve.cli import bench as bench_cli
from pdserve.cli import bench_flags
from pdserve.launch.cpu_layout import core_sets

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SETTINGS = EngineSettings("/models/m", "m", "float32", 3, 1024, (0, 1))


def run_json(ttfts: list[float], itl_s: float, goodput: float, out_tps: float,
             failed: int = 0) -> dict[str, Any]:
    """A ``pdserve.bench.run/v1`` result with the given per-request TTFTs and gaps."""
    requests: list[dict[str, Any]] = [
        {"prompt_tokens": 10, "output_tokens": 5, "cached_tokens": 0,
         "ttft_s": t, "tpot_s": itl_s, "e2e_s": t + 4 * itl_s,
         "itls_s": [itl_s * (1 + 0.1 * k) for k in range(4)], "start_s": i * 0.5,
         "error": None} for i, t in enumerate(ttfts)]
    ordered = sorted(ttfts)

    def stats(values: list[float]) -> dict[str, float]:
        return {"mean": float(np.mean(values)), "p50": float(np.percentile(values, 50)),
                "p90": float(np.percentile(values, 90)), "p99": float(np.percentile(values, 99))}

    return {"schema": "pdserve.bench.run/v1", "num_requests": len(ttfts) + failed,
            "completed": len(ttfts), "failed": failed,
            "errors": {"http_500": failed} if failed else {},
            "request_throughput": len(ttfts) / 10, "output_throughput": out_tps,
            "goodput": goodput, "ttft_s": stats(ordered), "tpot_s": stats([itl_s]),
            "itl_s": stats([x for r in requests for x in r["itls_s"]]),
            "e2e_s": stats([r["e2e_s"] for r in requests]), "requests": requests}


def constructed_report() -> CompareReport:
    spec = vllm_aggregated(SETTINGS, 8000).to_json()
    base = SystemResult("vllm", "vllm", spec, startup_s=12.0, stop={"clean": True}, runs=[
        RateRun(0.5, run_json([0.2, 0.4, 0.6], 0.050, 0.5, 40.0)),
        RateRun(1.0, run_json([1.0, 2.0, 3.0], 0.100, 0.2, 50.0))])
    pd = SystemResult("split", "pdserve", pdserve_up(SETTINGS, 8001, "split",
                                                     "--cpu-layout split").to_json(),
                      startup_s=20.0, stop={"clean": True}, runs=[
        RateRun(0.5, run_json([0.1, 0.2, 0.3], 0.025, 0.5, 40.0)),
        RateRun(1.0, None, error="bench run exited 1: boom")])
    dead = SystemResult("broken", "pdserve", pdserve_up(SETTINGS, 8002, "broken", "").to_json(),
                        error="pdserve-up exited with 1")
    return CompareReport({"model": "m", "dtype": "float32", "kv_cache_gib": 3,
                          "max_model_len": 1024, "enforce_eager": True, "seed": 7,
                          "slo": "ttft=2s,tpot=100ms", "workload_args": "--seed 7"},
                         {"cores": [0, 1], "cpu_model": "test", "cpu_flags": {}},
                         {"pdserve": "0.1.0"}, [0.5, 1.0], [base, pd, dead], "vllm")


def test_report_tables_carry_ratios_to_the_baseline_and_the_pngs_are_drawn(
        tmp_path: Path) -> None:
    files = write_report(constructed_report(), tmp_path)
    md = (tmp_path / "report.md").read_text()
    rate_05 = md.split("## 0.5 req/s")[1].split("##")[0]
    split_row = next(line for line in rate_05.splitlines() if line.startswith("| split |"))
    cells = [c.strip() for c in split_row.strip("|").split("|")]
    # goodput equal, TTFT p50 0.2 vs 0.4 -> 0.50x, ITL p50 halved, TPOT halved
    assert cells[1] == "0.500 (1.00×)"
    assert cells[4] == "0.200 (0.50×)"
    assert cells[6] == "25.0 (0.50×)" and cells[8].endswith("(0.50×)")
    vllm_row = next(line for line in rate_05.splitlines() if line.startswith("| vllm |"))
    assert "×" not in vllm_row  # the baseline has no ratio to itself
    rate_1 = md.split("## 1 req/s")[1]
    assert "| split | run failed |" in rate_1 and "| broken | failed to start |" in rate_1
    assert "**broken failed to start**: pdserve-up exited with 1" in md
    assert "split at 1 req/s: **run failed**: bench run exited 1: boom" in md

    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["schema"] == "pdserve.bench.compare/v1" and saved["baseline"] == "vllm"
    assert saved["systems"][0]["runs"][1]["result"]["ttft_s"]["p50"] == 2.0
    assert saved["systems"][2]["error"] == "pdserve-up exited with 1"

    pngs = [f for f in files if f.suffix == ".png"]
    assert {p.name for p in pngs} == {"ttft_cdf.png", "itl_cdf.png", "latency_vs_rate.png",
                                      "throughput_vs_rate.png"}
    for png in pngs:
        assert png.read_bytes()[:8] == PNG_SIGNATURE
        pixels = matplotlib.image.imread(png)
        assert pixels.shape[0] > 200 and pixels.shape[1] > 200
        assert float(pixels[..., :3].std()) > 0.05, f"{png.name} is blank"


def test_infinite_rate_is_written_as_a_string(tmp_path: Path) -> None:
    report = constructed_report()
    report.rates = [float("inf")]
    for system in report.systems:
        for run in system.runs:
            run.rate = float("inf")
    write_report(report, tmp_path)
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["rates"] == ["inf"] and saved["systems"][0]["runs"][0]["rate"] == "inf"
    assert "## inf req/s" in (tmp_path / "report.md").read_text()


def test_a_trace_replays_bound_stands_beside_the_prefix_hit(tmp_path: Path) -> None:
    write_report(constructed_report(), tmp_path / "plain")
    assert "trace bound" not in (tmp_path / "plain" / "report.md").read_text()
    report = constructed_report()
    for system in report.systems:
        for run in system.runs:
            if run.result is not None:
                run.result["trace"] = {"infinite_cache_token_ratio": 0.25,
                                       "infinite_cache_token_ratio_engine_block": {
                                           "16": 0.25, "128": 0.125}}
    write_report(report, tmp_path / "trace")
    md = (tmp_path / "trace" / "report.md").read_text()
    header = next(line for line in md.splitlines() if "prefix hit" in line)
    row = next(line for line in md.split("## 0.5 req/s")[1].splitlines()
               if line.startswith("| vllm |"))
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")],
                     [c.strip() for c in row.strip("|").split("|")], strict=True))
    assert (cells["trace bound"], cells["bound @128"]) == ("25.0%", "12.5%")


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_every_system_gets_the_same_engine_settings() -> None:
    agg = vllm_aggregated(SETTINGS, 9000)
    dis = vllm_disagg(SETTINGS, 9001, (9002, 9003), (9004, 9005))
    pd = pdserve_up(SETTINGS, 9006, "split", "--cpu-layout split --placement round_robin")
    engines = [agg.procs[0], *[p for p in dis.procs if p.name in ("prefill", "decode")]]
    for proc in engines:
        assert _flag(proc.argv, "--model") == "/models/m"
        assert _flag(proc.argv, "--served-model-name") == "m"
        assert _flag(proc.argv, "--dtype") == "float32"
        assert _flag(proc.argv, "--max-model-len") == "1024"
        assert "--enforce-eager" in proc.argv
        assert "--enable-prompt-tokens-details" in proc.argv  # cached tokens, as pdserve's
        assert proc.env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert agg.procs[0].env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert (_flag(pd.procs[0].argv, "--model"), _flag(pd.procs[0].argv, "--dtype"),
            _flag(pd.procs[0].argv, "--kv-cache-gib"),
            _flag(pd.procs[0].argv, "--max-model-len")) == ("/models/m", "float32", "3", "1024")
    assert pd.procs[0].argv[-4:] == ("--cpu-layout", "split", "--placement", "round_robin")
    (p_cores,), (d_cores,) = core_sets(1, 1, "split")  # what up does on this machine
    assert pd.cores == {"prefill": p_cores, "decode": d_cores}


def test_vllm_disagg_is_two_nixl_engines_on_separate_cores_behind_a_proxy() -> None:
    dis = vllm_disagg(SETTINGS, 9001, (9002, 9003), (9004, 9005))
    prefill, decode, proxy = dis.procs
    assert (prefill.env["VLLM_CPU_OMP_THREADS_BIND"], decode.env["VLLM_CPU_OMP_THREADS_BIND"]) \
        == ("0", "1")
    for proc, port, side, role in ((prefill, "9002", "9004", "kv_producer"),
                                   (decode, "9003", "9005", "kv_consumer")):
        kv = json.loads(_flag(proc.argv, "--kv-transfer-config"))
        assert kv["kv_connector"] == "NixlConnector" and kv["kv_buffer_device"] == "cpu"
        assert kv["kv_role"] == role
        assert _flag(proc.argv, "--port") == port
        assert proc.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == side
        assert proc.env["PDSERVE_NIXL_PROGRESS_DELAY_US"] == "1000"
    assert _flag(proxy.argv, "--prefill") == "http://127.0.0.1:9002"
    assert _flag(proxy.argv, "--decode") == "http://127.0.0.1:9003"
    with pytest.raises(ValueError, match="2\\+ cores"):
        vllm_disagg(EngineSettings("/m", "m", "float32", 1, 64, (0,)), 1, (2, 3), (4, 5))


TRACE = Path(__file__).parent.parent / "data" / "mooncake_conversation_sample.jsonl"


def _parse(argv: list[str]) -> argparse.Namespace:
    return bench_cli.build_parser().parse_args(["compare", *argv])


@pytest.mark.parametrize(("argv", "message"), [
    (["--request-rates", "1,x"], "'x' is not a number"),
    (["--request-rates", "0"], "must be > 0"),
    (["--run-timeout-s", "0"], "must be > 0"),
    (["--num-warmup", "-1"], "--num-warmup must be >= 0"),
    (["--kv-cache-gib", "0"], "kv_cache_gib > 0"),
    (["--pdserve", "no-equals-sign"], "expected NAME="),
    (["--pdserve", "a=--model /x"], "--model is set by compare"),
    (["--pdserve", "a=--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--pdserve", "a=--placement nope"], "invalid choice 'nope'"),
    (["--pdserve", "vllm="], "must differ"),
    (["--slo", "ttft=2"], "bad --slo item 'ttft=2'"),
    (["--workload", "sharegpt"], "needs --dataset"),
    (["--workload", "sharegpt", "--dataset", "/no/such/file.json"], "/no/such/file.json"),
    (["--workload", "chat-mix", "--mix", "0.7:80"], "0.7:80"),
    (["--workload", "mooncake-trace", "--dataset", str(TRACE), "--endpoint", "completions",
      "--trace-time-scale", "2"], "--trace-time-scale needs --request-rates inf"),
    (["--workload", "mooncake-trace", "--dataset", str(TRACE), "--request-rates", "inf"],
     "needs --endpoint completions"),
    (["--model", "/no/such/model"], "is not a directory"),
])
def test_bad_input_is_one_error_line_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
        message: str) -> None:
    out = tmp_path / "report"
    assert bench_cli.main(["compare", *argv, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pdserve bench: error: ")
    assert message in err[0]
    assert list(tmp_path.iterdir()) == []


def test_a_non_empty_output_dir_is_refused(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "old.txt").write_text("x")
    assert bench_cli.main(["compare", "--output-dir", str(tmp_path)]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def test_pdserve_entries_and_workload_flags_are_passed_as_given() -> None:
    assert parse_pdserve_entry("split=--cpu-layout split") == ("split", "--cpu-layout split")
    args = _parse(["--workload", "chat-mix", "--mix", "0.7:80:96,0.3:1200:16",
                   "--num-requests", "40", "--slo", "ttft=2s,tpot=100ms", "--seed", "3",
                   "--no-ignore-eos"])
    assert bench_flags.workload_args(args) == [
        "--seed", "3", "--workload", "chat-mix", "--mix", "0.7:80:96,0.3:1200:16",
        "--num-requests", "40", "--slo", "ttft=2s,tpot=100ms", "--no-ignore-eos"]


def test_a_trace_replays_flags_reach_every_run() -> None:
    args = _parse(["--workload", "mooncake-trace", "--dataset", str(TRACE), "--endpoint",
                   "completions", "--trace-block-tokens", "32", "--trace-time-scale", "2",
                   "--trace-start", "5", "--request-rates", "inf"])
    argv = bench_flags.workload_args(args)
    assert argv[argv.index("--trace-block-tokens"):] == [
        "--trace-block-tokens", "32", "--trace-time-scale", "2.0", "--trace-start", "5"]
    bench_flags.check_workload(argv)  # as pdserve bench run checks them: accepted


def test_the_store_off_vs_on_trace_recipe_is_accepted(tmp_path: Path) -> None:
    """docs/benchmarks.md's "Store off vs on" command (the sample trace for the full one):
    every entry is one ``pdserve up`` accepts, and the trace flags are run's."""
    p = "--num-prefill 2 --num-decode 1 --disagg always --kv-offload-gib 0.25"
    store = "--kv-store redis://127.0.0.1:6379"
    args = _parse(["--no-vllm", "--max-model-len", "4096", "--num-kv-blocks", "40",
                   "--pdserve", f"off-lru={p} --kv-tier-policy lru",
                   "--pdserve", f"off-default={p} --kv-tier-policy default",
                   "--pdserve", f"store-lru={p} --kv-tier-policy lru {store}/1",
                   "--pdserve", f"store-default={p} --kv-tier-policy default {store}/2",
                   "--workload", "mooncake-trace", "--dataset", str(TRACE),
                   "--endpoint", "completions", "--trace-block-tokens", "32",
                   "--trace-time-scale", "4", "--num-requests", "400", "--output-len", "16",
                   "--request-rates", "inf", "--output-dir", str(tmp_path / "out")])
    cfg = bench_flags.compare_config(args)
    assert [name for name, _ in cfg.pdserve] == ["off-lru", "off-default", "store-lru",
                                                 "store-default"]
    assert cfg.rates == (math.inf,) and "mooncake-trace" in cfg.workload_args


def test_num_prompts_is_num_requests_as_vllm_bench_serve_spells_it() -> None:
    run = bench_cli.build_parser().parse_args(
        ["run", "--base-url", "http://x", "--num-prompts", "10"])
    assert bench_flags.run_config(run).num_requests == 10
    # compare hands it to every run under pdserve's own name
    assert bench_flags.workload_args(_parse(["--num-prompts", "40"]))[-2:] == [
        "--num-requests", "40"]


def test_each_rate_has_prompts_of_its_own_and_every_system_the_same() -> None:
    """Rate i runs with seed + i: the same seed at every rate sent the same prompts again,
    and the server's prefix cache then answered the later rates (measured: 78-84 % of
    their prompt tokens cached)."""
    args = _parse(["--workload", "chat-mix", "--num-requests", "40", "--seed", "3",
                   "--request-rates", "0.5,1,1.5"])
    cfg = bench_flags.compare_config(args)
    agg, pd = vllm_aggregated(SETTINGS, 9000), pdserve_up(SETTINGS, 9006, "default", "")

    def seed(spec: Any, index: int) -> str:
        argv = compare.bench_argv(spec, cfg.rates[index], index, cfg, Path("r.json"))
        assert argv.count("--seed") == 1
        return _flag(tuple(argv), "--seed")

    assert [seed(agg, i) for i in range(3)] == ["3", "4", "5"]
    assert [seed(pd, i) for i in range(3)] == ["3", "4", "5"]
    assert _flag(tuple(compare.bench_argv(agg, 1.0, 1, cfg, Path("r.json"))),
                 "--request-rate") == "1"


def test_sigterm_mid_run_stops_the_system_and_writes_no_report(tmp_path: Path) -> None:
    """A real ``pdserve up --simulated`` (no vLLM): compare waits until it serves, is
    SIGTERMed during the run, stops it (no process of its tree left, port free) and
    leaves neither a report nor its temporary folder."""
    out = tmp_path / "report"
    argv = [sys.executable, "-m", "pdserve.cli.main", "bench", "compare", "--no-vllm",
            "--pdserve", "sim=--simulated --drain-timeout-s 2", "--request-rates", "0.2",
            "--num-requests", "50", "--workload", "random", "--input-len", "64",
            "--output-len", "4", "--startup-timeout-s", "120", "--output-dir", str(out)]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    tree: list[psutil.Process] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "sim: ready" in line:
                break
        else:
            pytest.fail("compare ended before the system was ready")
        tree = psutil.Process(proc.pid).children(recursive=True)
        port = int(next(p.cmdline()[p.cmdline().index("--port") + 1] for p in tree
                        if "up" in p.cmdline() and "--port" in p.cmdline()))
        assert len(tree) >= 4  # up, router, a prefill and a decode sim-worker
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree)
    assert port_free(port)
    assert list(tmp_path.iterdir()) == []


def test_disagg_proxy_prefills_one_token_then_streams_decode_with_its_kv_params() -> None:
    from fastapi.testclient import TestClient

    from pdserve.bench.compare.disagg_proxy import build_app

    seen: dict[str, dict[str, Any]] = {}
    params = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [3]}

    def engine(request: httpx.Request) -> httpx.Response:
        role = "prefill" if request.url.host == "prefill" else "decode"
        seen[role] = json.loads(request.content)
        if role == "prefill":
            return httpx.Response(200, json={"choices": [], "kv_transfer_params": params})
        return httpx.Response(200, content=b'data: {"x": 1}\n\ndata: [DONE]\n\n',
                              headers={"content-type": "text/event-stream"})

    app = build_app("http://prefill", "http://decode", transport=httpx.MockTransport(engine))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
            "stream": True, "stream_options": {"include_usage": True}}
    with TestClient(app) as client:
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n")
    prefill = seen["prefill"]
    assert prefill["max_tokens"] == 1 and "stream" not in prefill
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert seen["decode"] == dict(body, kv_transfer_params=params)


def test_the_tuned_baseline_gets_pdserves_engine_tuning_and_stock_does_not() -> None:
    from pdserve.worker.config import prefill_chunk_default
    from pdserve.worker.vllm.plugin import SPIN_ENV

    tuned = vllm_aggregated(SETTINGS, 9000, "vllm-tuned", tuned=True).procs[0]
    stock = vllm_aggregated(SETTINGS, 9001).procs[0]
    assert tuned.env[SPIN_ENV] == "0" and SPIN_ENV not in stock.env
    assert _flag(tuned.argv, "--long-prefill-token-threshold") == str(prefill_chunk_default(None))
    assert "--long-prefill-token-threshold" not in stock.argv
    assert _flag(tuned.argv, "--max-num-seqs") == _flag(stock.argv, "--max-num-seqs")


def test_vllm_disagg_uses_vllms_own_pd_router_when_installed(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    from pdserve.bench.compare import systems

    pdserve = (sys.executable, "-m", "pdserve.cli.main")
    for installed, command in (
            (True, (sys.executable, "-m", "vllm_router.launch_router")),
            (False, (*pdserve, "bench", "disagg-proxy"))):
        monkeypatch.setattr(systems, "has_vllm_router", lambda i=installed: i)
        router = vllm_disagg(SETTINGS, 9001, (9002, 9003), (9004, 9005),
                             command=pdserve).procs[-1]
        assert router.argv[:len(command)] == command and _flag(router.argv, "--port") == "9001"
        assert _flag(router.argv, "--prefill") == "http://127.0.0.1:9002"


def test_goodput_under_slos_derived_from_the_baselines_unloaded_run() -> None:
    from pdserve.bench.compare.report import add_derived_goodput, derive_slo

    unloaded = run_json([0.2, 0.2, 0.2], 0.050, 0.5, 40.0)
    slo = derive_slo(unloaded)
    assert slo == pytest.approx({"ttft_s": 0.6, "tpot_s": 2 * unloaded["itl_s"]["p50"]})
    loaded = run_json([0.3, 0.5, 0.9], 0.050, 0.5, 40.0)
    for r, tpot in zip(loaded["requests"], (0.05, 0.2, 0.05), strict=True):
        r["tpot_s"] = tpot
    assert slo is not None
    add_derived_goodput(loaded, slo)  # only the first meets both: 1 of 3 over 6 s
    assert loaded["goodput_derived"] == pytest.approx(1 / (3 / loaded["request_throughput"]))
    assert derive_slo({"ttft_s": {"p50": None}, "itl_s": {"p50": 0.1}}) is None


def test_a_run_whose_roles_changed_gets_a_timeline_plot(tmp_path: Path) -> None:
    report = constructed_report()
    split = report.systems[1]
    assert split.runs[0].result is not None
    split.runs[0].result["roles_timeline"] = [[0.0, 1, 1], [5.0, 1, 1], [6.0, 0, 2],
                                              [12.0, 0, 2]]
    base_run = report.systems[0].runs[0].result
    assert base_run is not None
    base_run["roles_timeline"] = []  # not a pdserve system: never sampled
    files = write_report(report, tmp_path)
    (timeline,) = [f for f in files if f.name.startswith("timeline-")]
    assert timeline.name == "timeline-split-0.5.png"
    pixels = matplotlib.image.imread(timeline)
    assert float(pixels[..., :3].std()) > 0.05


def test_role_sampler_counts_placeable_workers_by_role() -> None:
    import http.server
    import threading

    from pdserve.bench.compare.roles_sampler import RoleSampler

    class Workers(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = json.dumps({"workers": [
                {"role": "prefill", "healthy": True}, {"role": "decode", "healthy": True},
                {"role": "decode", "healthy": False}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Workers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with RoleSampler(f"http://127.0.0.1:{server.server_address[1]}", 0.05) as roles:
            deadline = time.monotonic() + 5
            while len(roles.samples) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert [s[1:] for s in roles.samples[:2]] == [[1, 1], [1, 1]]
    finally:
        server.shutdown()


def test_the_disagg_proxy_runs_as_the_hidden_bench_subcommand_vllm_disagg_starts() -> None:
    """``vllm_disagg``'s proxy command line (``pdserve bench disagg-proxy``) serves; with
    no engine behind it, ``/v1/models`` answers 503."""
    from pdserve.bench.compare import systems
    from pdserve.core import process
    from pdserve.core.ports import free_port

    port, dead = free_port(), f"http://127.0.0.1:{free_port()}"
    command = (sys.executable, "-m", "pdserve.cli.main")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(systems, "has_vllm_router", lambda: False)
        spec = vllm_disagg(SETTINGS, port, (9002, 9003), (9004, 9005), command=command)
    argv = [*spec.procs[-1].argv]
    argv[argv.index("--prefill") + 1] = argv[argv.index("--decode") + 1] = dead
    proc = process.spawn(argv)
    try:
        def probe() -> str:
            reply = httpx.get(f"{spec.base_url}/v1/models", timeout=5.0)
            return "" if reply.status_code == 503 else f"HTTP {reply.status_code}"

        process.wait_ready(probe, 60.0, exited=lambda: None if proc.poll() is None
                           else f"exit {proc.returncode}", interval_s=0.2)
    finally:
        report = process.stop([proc], 10.0)
    assert report.left_behind == [] and port_free(port)


def test_a_small_kv_cache_reaches_every_engine_that_computes_prompts() -> None:
    """``--num-kv-blocks``: the same cache for aggregated vLLM, vLLM's prefill engine and
    pdserve's prefill workers (decode engines keep --kv-cache-gib), so a working set
    larger than it is larger for every system alike."""
    small = dataclasses.replace(SETTINGS, num_kv_blocks=12)

    def blocks(argv: tuple[str, ...], flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv else None

    (vllm,) = vllm_aggregated(small, 1).procs
    assert blocks(vllm.argv, "--num-gpu-blocks-override") == "12"
    prefill, decode, _ = vllm_disagg(small, 1, (2, 3), (4, 5)).procs
    assert blocks(prefill.argv, "--num-gpu-blocks-override") == "12"
    assert blocks(decode.argv, "--num-gpu-blocks-override") is None
    (up,) = pdserve_up(small, 1, "host", "--kv-offload-gib 2").procs
    assert blocks(up.argv, "--num-kv-blocks") == "12" and up.argv[-2:] == (
        "--kv-offload-gib", "2")
    (plain,) = pdserve_up(SETTINGS, 1, "off", "").procs
    assert "--num-kv-blocks" not in plain.argv


def test_costs_per_million_tokens_charge_what_each_system_used(tmp_path: Path) -> None:
    """vllm ran on 2 cores, the split pdserve on 2 (1 + 1): at $0.36 per core-hour each
    costs $0.72/hour; a run of 3 requests at 0.3 req/s lasts 10 s, $0.002. The within-SLO
    price charges it all to the tokens of the requests that met the SLOs."""
    from pdserve.bench.compare.cost import Price, cores_of

    report = constructed_report()
    report.settings["cost_per_hour"] = Price.parse("0.36/core").to_json()
    base, split = report.systems[0], report.systems[1]
    assert cores_of(base.spec) == cores_of(split.spec) == {0, 1}
    slo = {"ttft_s": 0.5, "tpot_s": 0.1}  # 0.2 and 0.4 meet it, 0.6 does not
    compare.add_costs(report.systems, Price.parse("0.36"), slo)

    cost = base.runs[0].result["cost"]  # type: ignore[index]
    assert cost["usd_per_hour"] == pytest.approx(0.72)
    assert cost["usd"] == pytest.approx(0.72 * 10 / 3600)
    assert cost["usd_per_m_input"] == pytest.approx(cost["usd"] / 30 * 1e6)
    assert cost["usd_per_m_output"] == pytest.approx(cost["usd"] / 15 * 1e6)
    assert cost["tokens_in_slo"] == 2 * 15
    assert cost["usd_per_m_tokens_in_slo"] == pytest.approx(cost["usd"] / 30 * 1e6)
    node = {"usd_per_hour": 2.4, "unit": "node"}
    assert Price.parse("2.4/node").to_json() == node
    assert Price.parse("2.4/node").hourly(split.spec) == 2.4
    compare.add_costs(report.systems, Price.parse("0.36"), {"ttft_s": 0.01})
    assert base.runs[0].result["cost"]["usd_per_m_tokens_in_slo"] is None  # type: ignore[index]
    simulated = pdserve_up(SETTINGS, 8003, "sim", "--simulated").to_json()
    assert Price.parse("0.36").hourly(simulated) is None  # its cores are not known
    for bad in ("abc", "0", "-1/core", "3/gpu"):
        with pytest.raises(ValueError, match="--cost-per-hour"):
            Price.parse(bad)

    files = write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "Cost: $0.36 per core-hour" in md
    header = next(line for line in md.splitlines() if line.startswith("| system | goodput"))
    assert header.split("|")[-4:-1] == [" $/M out tok ", " $/M tok in SLO ", " errors "]
    assert "cost_vs_rate.png" in {f.name for f in files}
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["systems"][1]["runs"][0]["result"]["cost"]["usd_per_hour"] == 0.72
