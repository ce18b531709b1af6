"""The ``pdserve`` command line: bad flags and environment values are one-line
errors with exit code 2, and each component's config comes from its flags."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from unit.cli_parsers import all_parsers

from pdserve.cli.configs import disagg_config, router_config, sim_config, up_config, worker_config
from pdserve.cli.main import main
from pdserve.cli.parser import build_parser
from pdserve.core.dtype import resolve_dtype
from pdserve.core.model import ResolvedModel
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.launch.up import UpConfig, plan
from pdserve.membership import MembershipConfig
from pdserve.router.dispatch.policies.disagg import DisaggConfig
from pdserve.router.server import RouterConfig
from pdserve.worker.config import prefill_chunk_default, prefill_max_running_default
from pdserve.worker.engine import EngineConfig
from pdserve.worker.sim.engine import SimConfig

MODEL = ResolvedModel(Path("/models/tiny"), "tiny")


@pytest.fixture(autouse=True)
def _no_pdserve_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("PDSERVE_") and n != "PDSERVE_CACHE"]:
        monkeypatch.delenv(name)


def _error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize(("env", "argv", "expected"), [
    ({"PDSERVE_PORT": "abc"}, ["router"], ["--port", "PDSERVE_PORT", "'abc'"]),
    ({}, ["up", "--dtype", "fp8x"], ["--dtype", "'fp8x'", "float32"]),
    ({"PDSERVE_DTYPE": "fp8x"}, ["prefill"], ["--dtype", "PDSERVE_DTYPE", "'fp8x'"]),
    ({}, ["router", "--placement", "nearest"], ["--placement", "cache_aware, least_loaded"]),
    ({}, ["decode", "--port", "-1"], ["--port", "0 to 65535"]),
    ({"PDSERVE_KV_CHECKSUM": "maybe"}, ["decode"], ["--kv-checksum", "PDSERVE_KV_CHECKSUM"]),
    ({"PDSERVE_LEASE_S": "0"}, ["prefill"], ["--lease-s", "PDSERVE_LEASE_S", "> 0"]),
    ({}, ["up", "--transport", "carrier-pigeon"], ["--transport", "tcp, torch, ucx"]),
])
def test_a_bad_flag_or_env_value_is_one_line_naming_it(
    env: dict[str, str], argv: list[str], expected: list[str],
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    err = _error_of(argv, capsys)
    assert err.startswith(f"pdserve {argv[0]}: error: argument ")
    for part in expected:
        assert part in err


def test_a_flag_wins_over_a_bad_env_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_PORT", "abc")
    assert build_parser().parse_args(["router", "--port", "9000"]).port == 9000


def test_env_values_are_parsed_like_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_PORT", "9001")
    monkeypatch.setenv("PDSERVE_KV_PUSH", "off")
    monkeypatch.setenv("PDSERVE_LOG_LEVEL", "debug")
    args = build_parser().parse_args(["decode"])
    assert (args.port, args.kv_push, args.log_level) == (9001, False, "DEBUG")


def test_bad_env_in_a_subprocess_has_no_traceback() -> None:
    env = dict(os.environ, PDSERVE_PORT="abc")
    done = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "router"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()]
    assert "PDSERVE_PORT" in done.stderr and "--port" in done.stderr
    assert "Traceback" not in done.stderr


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"pdserve {version('pdserve')}"


@pytest.mark.parametrize("command", ["up", "router", "prefill", "decode", "sim-worker"])
def test_help_shows_defaults_choices_and_env_names(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # undo the help's line wrapping
    assert "[env PDSERVE_PORT] (default: " in out
    assert "[env PDSERVE_LOG_LEVEL] (default: INFO)" in out
    if command != "sim-worker":
        assert "--max-model-len" in out and "(default: 4096)" in out
    if command in ("up", "prefill", "decode"):
        assert "--dtype {auto,float32,bfloat16,float16}" in out
        assert "--transport {tcp,torch,ucx}" in out


# ---- each component's config from its flags --------------------------------------------

def test_router_config_from_args() -> None:
    args = build_parser().parse_args([
        "router", "--port", "8100", "--prefill", "a:1, b:2", "--decode", "c:3",
        "--placement", "least_loaded", "--max-model-len", "2048"])
    assert router_config(args, MODEL) == RouterConfig(
        model_path="/models/tiny", served_model_name="tiny", prefill=("a:1", "b:2"),
        decode=("c:3",), port=8100, max_model_len=2048, placement="least_loaded",
        membership=MembershipConfig("static", prefill=("a:1", "b:2"), decode=("c:3",)))
    named = build_parser().parse_args(["router", "--etcd", "http://e:2379",
                                       "--served-model-name", "chat"])
    config = router_config(named, MODEL)
    assert (config.served_model_name, config.membership.kind) == ("chat", "etcd")


def test_up_config_from_args() -> None:
    args = build_parser().parse_args([
        "up", "--dtype", "float32", "--num-prefill", "2", "--transport", "ucx", "--no-kv-push",
        "--with-etcd", "--num-kv-blocks", "64", "--cpu-layout", "split"])
    # (the flags handed on as parsed, router_flags and worker_flags: test_cli_handoff.py)
    up = up_config(args, MODEL)
    assert "--no-kv-push" in up.worker_flags
    assert replace(up, router_flags=(), worker_flags=()) == UpConfig(
        model="/models/tiny", dtype="float32", num_prefill=2, transport="ucx",
        with_etcd=True, num_kv_blocks=64, cpu_layout="split")
    auto = up_config(build_parser().parse_args(["up"]), MODEL)
    assert replace(auto, router_flags=(), worker_flags=()) == UpConfig(
        model="/models/tiny", dtype=resolve_dtype("auto").dtype)
    assert auto.dtype_choice == resolve_dtype("auto")  # what up prints
    simulated = up_config(build_parser().parse_args(["up", "--simulated"]), MODEL)
    assert (simulated.dtype, simulated.dtype_choice) == ("auto", None)  # no engine


def test_decode_cache_is_on_by_default_and_up_passes_off_on(tmp_path: Path) -> None:
    assert router_config(build_parser().parse_args(["router", "--decode", "c:3"]),
                         MODEL).decode_cache
    up = up_config(build_parser().parse_args(["up", "--decode-cache", "off"]), MODEL)
    (router_argv,) = [c.argv for c in plan(up, tmp_path) if c.name == "router"]
    child = build_parser().parse_args(router_argv[router_argv.index("router"):])
    assert not router_config(child, MODEL).decode_cache


def test_disagg_flags_reach_the_router_and_up_passes_them_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert router_config(build_parser().parse_args(["router", "--decode", "c:3"]),
                         MODEL).disagg == DisaggConfig()  # auto by default
    monkeypatch.setenv("PDSERVE_LOCAL_DECODE_MAX_RUNNING", "2")
    argv = ["--disagg", "never", "--local-prefill-max-tokens", "128",
            "--local-prefill-max-queued-tokens", "1000"]
    expected = DisaggConfig("never", 128, 1000, 2)
    router = router_config(build_parser().parse_args(
        ["router", "--decode", "c:3", *argv]), MODEL)
    assert router.disagg == expected
    up = up_config(build_parser().parse_args(["up", *argv]), MODEL)
    (router_argv,) = [c.argv for c in plan(up, tmp_path) if c.name == "router"]
    child = build_parser().parse_args(router_argv[router_argv.index("router"):])
    assert disagg_config(child) == expected


def test_a_bad_disagg_mode_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = _error_of(["router", "--disagg", "sometimes"], capsys)
    assert "--disagg" in err and "auto, always, never" in err


def test_worker_config_from_args(monkeypatch: pytest.MonkeyPatch) -> None:
    # Bound to 0.0.0.0, a worker advertises the address its hostname resolves to.
    monkeypatch.setattr("socket.gethostbyname", lambda name: "127.0.0.1")
    args = build_parser().parse_args([
        "prefill", "--host", "0.0.0.0", "--port", "6000", "--worker-id", "p-1",
        "--dtype", "float32", "--kv-push", "--kv-checksum", "--lease-s", "5",
        "--cpu-cores", "0-1", "--num-kv-blocks", "32"])
    config = worker_config(args, MODEL)
    assert (config.worker_id, config.host, config.port, config.advertise_host) == (
        "p-1", "0.0.0.0", 6000, "127.0.0.1")
    assert config.membership == MembershipConfig("static")
    engine = config.engine
    assert engine.connector == ConnectorConfig(
        engine_id="p-1", kv_host="127.0.0.1", kv_port=7000, kv_bind_host="0.0.0.0",
        lease_s=5.0, push=True, kv_checksum=True)
    assert engine.kv_events == f"p-1-{os.getpid()}"
    assert engine == EngineConfig(
        model_path="/models/tiny", served_model_name="tiny", role="prefill",
        connector=engine.connector, dtype="float32", cpu_threads_bind="0-1",
        num_kv_blocks=32, kv_events=engine.kv_events,
        prefill_chunk_tokens=prefill_chunk_default(None),  # 256 on CPU, no cap on a GPU
        prefill_max_running=prefill_max_running_default(None))  # 1 on CPU, none on a GPU
    assert engine.prefill_order == "shortest"
    assert config.role == "prefill"
    fifo = worker_config(build_parser().parse_args(
        ["prefill", "--prefill-max-running", "3", "--prefill-order", "fifo"]), MODEL).engine
    assert (fifo.prefill_max_running, fifo.prefill_order) == (3, "fifo")


@pytest.mark.parametrize("resolved", ["10.1.2.3", None])
def test_a_worker_on_every_interface_advertises_its_hostname_address(
        monkeypatch: pytest.MonkeyPatch, resolved: str | None) -> None:
    """Each replica of a scaled compose service (or a pod) advertises its own IP; a name
    that does not resolve falls back to loopback. A given bind address is advertised as is."""
    def gethostbyname(name: str) -> str:
        if resolved is None:
            raise OSError("no such host")
        return resolved

    monkeypatch.setattr("socket.gethostbyname", gethostbyname)
    config = worker_config(
        build_parser().parse_args(["decode", "--host", "0.0.0.0"]), MODEL)
    expected = resolved or "127.0.0.1"
    assert (config.advertise_host, config.engine.connector.kv_host) == (expected, expected)
    bound = worker_config(
        build_parser().parse_args(["decode", "--host", "10.9.9.9"]), MODEL)
    assert bound.advertise_host == "10.9.9.9"


def test_decode_worker_config_advertises_and_registers() -> None:
    args = build_parser().parse_args([
        "decode", "--advertise-host", "10.0.0.5", "--kv-port", "7100", "--no-kv-push",
        "--etcd", "http://e:2379", "--cluster", "blue", "--compile"])
    config = worker_config(args, MODEL)
    assert config.worker_id.startswith("decode-") and config.port == 50061
    # Every engine publishes KV events: a decode may be switched to prefill.
    assert config.engine.kv_events is not None and not config.engine.enforce_eager
    assert (config.engine.connector.kv_host, config.engine.connector.kv_port) == (
        "10.0.0.5", 7100)
    assert (config.membership.kind, config.membership.cluster) == ("etcd", "blue")


def test_sim_config_from_args() -> None:
    args = build_parser().parse_args([
        "sim-worker", "--role", "decode", "--worker-id", "s-1", "--block-size", "32",
        "--prefill-us-per-token", "10", "--decode-ms-per-token", "4"])
    config = sim_config(args)
    assert config == SimConfig(
        role="decode", worker_id="s-1", block_size=32,
        prefill_s_per_token=config.prefill_s_per_token, decode_s_per_token=4e-3)
    assert config.prefill_s_per_token == pytest.approx(10e-6)


def test_shm_spin_reaches_every_engine_from_up(tmp_path: Path) -> None:
    """``--shm-spin-s`` (unset: each worker's own default) goes to every engine up starts."""
    args = build_parser().parse_args(["up", "--shm-spin-s", "1", "--num-prefill", "1"])
    cfg = up_config(args, MODEL)
    workers = [c for c in plan(cfg, tmp_path) if c.name != "router"]
    assert len(workers) == 2
    for child in workers:
        assert child.argv[child.argv.index("--shm-spin-s") + 1] == "1.0"
        worker_args = build_parser().parse_args(child.argv[3:])
        assert worker_config(worker_args, MODEL).engine.shm_spin_s == 1.0
    default = up_config(build_parser().parse_args(["up"]), MODEL)
    assert all("--shm-spin-s" not in c.argv for c in plan(default, tmp_path))


def test_kv_offload_reaches_every_engine_from_up(tmp_path: Path) -> None:
    """``--kv-offload-gib`` (0: no host tier) reaches each worker's connector."""
    args = build_parser().parse_args(["up", "--kv-offload-gib", "0.5", "--num-prefill", "1"])
    workers = [c for c in plan(up_config(args, MODEL), tmp_path) if c.name != "router"]
    assert len(workers) == 2
    for child in workers:
        worker_args = build_parser().parse_args(child.argv[3:])
        assert worker_config(worker_args, MODEL).engine.connector.kv_offload_gib == 0.5
    default = up_config(build_parser().parse_args(["up"]), MODEL)
    for child in [c for c in plan(default, tmp_path) if c.name != "router"]:
        worker_args = build_parser().parse_args(child.argv[3:])
        assert worker_config(worker_args, MODEL).engine.connector.kv_offload_gib == 0.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--kv-offload-gib", "-1"])


def test_bench_without_the_bench_extra_runs_and_only_compare_asks_for_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Without matplotlib (a router or worker image) ``bench run`` works; ``bench compare``
    (its plots) says how to get it in one line before it checks its flags or starts a
    system."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # pdserve.bench not yet imported
    for name in [n for n in sys.modules if n.startswith(("pdserve.bench", "pdserve.cli.bench"))]:
        monkeypatch.delitem(sys.modules, name)
    fresh = importlib.import_module("pdserve.cli.bench")  # every subcommand's module
    ran: list[Any] = []

    def fake_main(cfg: Any) -> int:
        ran.append(cfg)
        return 0

    monkeypatch.setattr(fresh.run, "main", fake_main)
    assert main(["bench", "run", "--base-url", "http://x", "--num-prompts", "3"]) == 0
    assert [cfg.num_requests for cfg in ran] == [3]

    def started(args: argparse.Namespace) -> None:
        pytest.fail("compare went on without matplotlib")

    monkeypatch.setattr(fresh.bench_flags, "compare_config", started)
    assert main(["bench", "compare", "--output-dir", "x"]) == 2
    assert capsys.readouterr().err == ("pdserve bench: error: matplotlib is not installed; "
                                       "pip install 'pdserve[bench]'\n")


def test_every_help_is_plain_text_without_rest_markup() -> None:
    helps = {parser.prog: parser.format_help() for parser in all_parsers().values()}
    assert {"pdserve up", "pdserve bench sweep", "pdserve bench disagg-proxy"} <= set(helps)
    assert [prog for prog, text in helps.items() if "``" in text] == []
