"""``core.ports``: a process never hands out one port twice, nor a reserved one, and
``up`` hands its children distinct ports, none of them the router's."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from pdserve.core import ports
from pdserve.core.ports import free_port, reserve
from pdserve.launch.up import UpConfig, plan
from pdserve.router.http.edge.config import EdgeConfig


def test_a_port_the_random_pick_repeats_is_handed_out_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_handed", set())
    picks = itertools.cycle([21001, 21001, 21002, 21001, 21002, 21003])
    monkeypatch.setattr(ports.random, "randint", lambda lo, hi: next(picks))
    assert [free_port(), free_port(), free_port()] == [21001, 21002, 21003]


def test_a_reserved_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_handed", set())
    picks = iter([21005, 21005, 21006])
    monkeypatch.setattr(ports.random, "randint", lambda lo, hi: next(picks))
    reserve(21005, 0)
    assert free_port() == 21006


def test_up_hands_every_child_its_own_ports_none_of_the_routers(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A small range: repeats are certain unless free_port keeps track.
    monkeypatch.setattr(ports, "_handed", set())
    monkeypatch.setattr(ports, "_RANGE", (21100, 21140))
    cfg = UpConfig(model="/models/tiny", port=21100, num_prefill=3, num_decode=3,
                   edge=EdgeConfig(admin_port=21101))
    given = []
    for child in plan(cfg, tmp_path):
        argv = child.argv
        given += [int(argv[i + 1]) for i, a in enumerate(argv)
                  if a in ("--port", "--kv-port", "--metrics-port", "--admin-port")]
    assert len(given) == len(set(given)) and len(given) == 6 * 3 + 2, given
