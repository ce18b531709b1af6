"""``pdserve up`` hands its router the flags it parsed (but its keys and admin listener:
``test_router_auth.py``), and every vLLM worker the engine and transport flags up does not
decide itself (``handed_on``: each flag rendered by its own ``Flag.argv``); each child
parses them back to the same values."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from pdserve.cli.configs import HANDED_TO_ROUTER, HANDED_TO_WORKERS, up_config
from pdserve.cli.flags import FLAGS
from pdserve.cli.parser import build_parser
from pdserve.core.model import ResolvedModel
from pdserve.launch.up import plan

MODEL = ResolvedModel(Path("/models/tiny"), "tiny")

# A value other than its default for every flag up hands its router.
GIVEN = {
    "placement": ["--placement", "least_loaded"],
    "kv-pool": ["--kv-pool", "off"],
    "decode-cache": ["--decode-cache", "off"],
    "disagg": ["--disagg", "slo"],
    "local-prefill-max-tokens": ["--local-prefill-max-tokens", "128"],
    "local-prefill-max-queued-tokens": ["--local-prefill-max-queued-tokens", "1000"],
    "local-decode-max-running": ["--local-decode-max-running", "2"],
    "slo-ttft-ms": ["--slo-ttft-ms", "250.5"],
    "slo-itl-ms": ["--slo-itl-ms", "40"],
    "link-aware": ["--no-link-aware"],
    "planner": ["--planner", "export"],
    "planner-interval-s": ["--planner-interval-s", "7.5"],
    "planner-window-s": ["--planner-window-s", "30"],
    "planner-hold-s": ["--planner-hold-s", "12"],
    "planner-cooldown-s": ["--planner-cooldown-s", "9"],
    "planner-demand-scale": ["--planner-demand-scale", "2"],
    "tool-call-parser": ["--tool-call-parser", "hermes"],
    "enable-auto-tool-choice": ["--enable-auto-tool-choice"],
    "weight-transfer-backend": ["--weight-transfer-backend", "gloo"],
    "weight-transfer-allow": ["--weight-transfer-allow", "10.0.0.0/8"],
    "max-concurrent-requests": ["--max-concurrent-requests", "8"],
    "max-queued-requests": ["--max-queued-requests", "3"],
    "max-queue-wait-s": ["--max-queue-wait-s", "2.5"],
    "max-body-bytes": ["--max-body-bytes", "1000"],
    "drain-timeout-s": ["--drain-timeout-s", "7"],
    "tenant-isolation": ["--tenant-isolation", "key"],  # (with an --api-key, below)
    "tenant-limits-share": ["--tenant-limits-share", "0.5"],
}


# And for every flag up hands its vLLM workers.
GIVEN_WORKERS = {
    "kv-cache-gib": ["--kv-cache-gib", "3"],
    "kv-offload-gib": ["--kv-offload-gib", "0.5"],
    "kv-tier-policy": ["--kv-tier-policy", "lru"],
    "shm-spin-s": ["--shm-spin-s", "0.25"],
    "prefill-chunk-tokens": ["--prefill-chunk-tokens", "64"],
    "prefill-max-running": ["--prefill-max-running", "2"],
    "prefill-order": ["--prefill-order", "fifo"],
    "kv-checksum": ["--kv-checksum"],
    "kv-throttle-mib-s": ["--kv-throttle-mib-s", "100"],
    "kv-stall-s": ["--kv-stall-s", "5"],
    "kv-link-max-age-s": ["--kv-link-max-age-s", "30"],
    "kv-handoff-lossy": ["--kv-handoff-lossy"],
    "kv-push": ["--kv-push"],
    "enable-lora": ["--enable-lora"],
    "lora-modules": ["--lora-modules", "sql=/adapters/sql", "--lora-modules",
                     '{"name": "a=b", "path": "/x"}'],
    "max-loras": ["--max-loras", "2"],
    "max-lora-rank": ["--max-lora-rank", "8"],
}


@pytest.fixture(autouse=True)
def _no_pdserve_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("PDSERVE_") and n != "PDSERVE_CACHE"]:
        monkeypatch.delenv(name)


def _router_argv(up: argparse.Namespace, tmp_path: Path) -> list[str]:
    (argv,) = [c.argv for c in plan(up_config(up, MODEL), tmp_path) if c.name == "router"]
    return argv[argv.index("router"):]


def test_the_router_parses_up_s_policy_flags_back_to_the_same_values(tmp_path: Path) -> None:
    assert set(GIVEN) == set(HANDED_TO_ROUTER)  # a new flag in the groups needs a value here
    up = build_parser().parse_args(["up", "--api-key", "key-one-1234",
                                    *(word for words in GIVEN.values() for word in words)])
    router = build_parser().parse_args(_router_argv(up, tmp_path))
    for name in GIVEN:
        dest = FLAGS[name].dest
        assert getattr(router, dest) == getattr(up, dest) != FLAGS[name].default, name


def test_defaults_and_environment_values_are_handed_on_as_parsed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_PLANNER_HOLD_S", "33")
    up = build_parser().parse_args(["up"])
    argv = _router_argv(up, tmp_path)
    monkeypatch.delenv("PDSERVE_PLANNER_HOLD_S")  # the router's parse: its argv alone
    router = build_parser().parse_args(argv)
    for name in HANDED_TO_ROUTER:
        dest = FLAGS[name].dest
        assert getattr(router, dest) == getattr(up, dest), name
    assert router.planner_hold_s == 33.0


def test_a_bad_policy_flag_fails_before_any_child_starts() -> None:
    args = build_parser().parse_args(["up", "--enable-auto-tool-choice"])
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        up_config(args, MODEL)


def test_every_vllm_worker_parses_up_s_engine_flags_back_to_the_same_values(
        tmp_path: Path) -> None:
    """Before they were handed on, up took --kv-link-max-age-s and --kv-handoff-lossy
    and never gave them to its workers."""
    assert set(GIVEN_WORKERS) == set(HANDED_TO_WORKERS)
    up = build_parser().parse_args(
        ["up", "--dtype", "float32", *(w for words in GIVEN_WORKERS.values() for w in words)])
    workers = [c for c in plan(up_config(up, MODEL), tmp_path) if c.name != "router"]
    assert [c.name for c in workers] == ["prefill-0", "decode-0"]
    for child in workers:
        worker = build_parser().parse_args(child.argv[child.argv.index(child.name[:-2]):])
        for name in GIVEN_WORKERS:
            dest = FLAGS[name].dest
            assert getattr(worker, dest) == getattr(up, dest) != FLAGS[name].default, name
