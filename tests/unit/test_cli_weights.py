"""The weights flags (``--weight-version``, ``--weight-transfer-backend``): parsed and
checked like every flag, carried into each worker's ``EngineConfig``, and handed by
``up`` to the workers it starts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli.configs import up_config, worker_config
from pdserve.cli.main import main
from pdserve.cli.parser import build_parser
from pdserve.core.model import ResolvedModel
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.launch.up import UpConfig, plan
from pdserve.worker.engine import EngineConfig

MODEL = ResolvedModel(Path("/models/tiny"), "tiny")


@pytest.fixture(autouse=True)
def _no_pdserve_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("PDSERVE_") and n != "PDSERVE_CACHE"]:
        monkeypatch.delenv(name)


def _gpu(monkeypatch: pytest.MonkeyPatch, present: bool) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: present)


def test_a_worker_starts_on_the_default_version_without_a_transfer_engine() -> None:
    engine = worker_config(build_parser().parse_args(["decode"]), MODEL).engine
    assert (engine.weight_version, engine.weight_transfer_backend) == ("default", None)


def test_the_flags_reach_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu(monkeypatch, True)
    args = build_parser().parse_args(["prefill", "--weight-version", "step-40",
                                      "--weight-transfer-backend", "nccl"])
    engine = worker_config(args, MODEL).engine
    assert (engine.weight_version, engine.weight_transfer_backend) == ("step-40", "nccl")
    monkeypatch.setenv("PDSERVE_WEIGHT_VERSION", "step-41")
    assert worker_config(build_parser().parse_args(["decode"]), MODEL).engine.weight_version \
        == "step-41"


@pytest.mark.parametrize(("env", "argv", "expected"), [
    ({}, ["decode", "--weight-version", ""], ["--weight-version", "empty"]),
    ({"PDSERVE_WEIGHT_VERSION": " "}, ["up"], ["--weight-version", "PDSERVE_WEIGHT_VERSION"]),
    ({}, ["prefill", "--weight-transfer-backend", "rdma"],
     ["--weight-transfer-backend", "'rdma'", "nccl, ipc, gloo"]),
])
def test_a_bad_weights_flag_is_one_line_naming_it(
    env: dict[str, str], argv: list[str], expected: list[str],
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert all(part in err for part in expected), err


def test_a_transfer_engine_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu(monkeypatch, False)
    args = build_parser().parse_args(["decode", "--weight-transfer-backend", "ipc"])
    with pytest.raises(ValueError, match="needs a GPU"):
        worker_config(args, MODEL)
    up = build_parser().parse_args(["up", "--weight-transfer-backend", "ipc"])
    with pytest.raises(ValueError, match="needs a GPU"):
        up_config(up, MODEL)
    simulated = build_parser().parse_args(["up", "--simulated", "--weight-transfer-backend",
                                           "ipc"])
    with pytest.raises(ValueError, match="simulated workers"):
        up_config(simulated, MODEL)
    gloo = build_parser().parse_args(["decode", "--weight-transfer-backend", "gloo"])
    assert worker_config(gloo, MODEL).engine.weight_transfer_backend == "gloo"  # CPU tensors


def test_up_hands_both_flags_to_every_worker(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _gpu(monkeypatch, True)
    args = build_parser().parse_args(["up", "--dtype", "float32", "--num-prefill", "1",
                                      "--weight-version", "v7",
                                      "--weight-transfer-backend", "nccl"])
    cfg = up_config(args, MODEL)
    assert (cfg.weight_version, cfg.weight_transfer_backend) == ("v7", "nccl")
    workers = [c for c in plan(cfg, tmp_path) if c.name != "router"]
    assert len(workers) == 2
    for child in workers:
        engine = worker_config(build_parser().parse_args(child.argv[3:]), MODEL).engine
        assert (engine.weight_version, engine.weight_transfer_backend) == ("v7", "nccl")
    default = plan(UpConfig(model="/m"), tmp_path)
    assert all("--weight-transfer-backend" not in c.argv for c in default)
    with pytest.raises(ValueError, match="weight-version"):
        UpConfig(model="/m", weight_version="")


def test_an_engine_config_refuses_an_empty_version_or_an_unknown_transfer_engine() -> None:
    base: dict[str, Any] = dict(model_path="/m", served_model_name="m", role="decode",
                                connector=ConnectorConfig(engine_id="d-1"))
    with pytest.raises(ValueError, match="weight_version"):
        EngineConfig(**base, weight_version="")
    with pytest.raises(ValueError, match="nccl, ipc"):
        EngineConfig(**base, weight_transfer_backend="rdma")
