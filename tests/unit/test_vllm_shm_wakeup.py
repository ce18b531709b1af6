"""vLLM's shared-memory queue wake-up (``SpinCondition``) on its own sockets, no engine.

pdserve's plugin, found and run as vLLM runs it in each engine process, and only under
``PDSERVE_VLLM_SHM_SPIN_S``: the writer processes its socket's command mailbox before
each ping, so a ping sent right after the previous one (the Worker answering
``execute_model`` then ``sample_tokens``) is not dropped; and an idle reader whose ping
went missing anyway looks at its queue again after ``RECHECK_MS``, not vLLM's 5 s."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from vllm.distributed.device_communicators import shm_broadcast
from vllm.platforms import current_platform
from vllm.plugins import load_plugins_by_group
from vllm.utils.network_utils import get_open_zmq_ipc_path
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from pdserve.worker.vllm import plugin as vllm_plugin

ROUNDS = 100
VLLM_RECHECK_MS = 5000  # vLLM's SHM_READER_RECHECK_INTERVAL_MS
# A ping arrives in well under a millisecond or never: only a hang waits this long.
HANG_MS = 10_000

SpinCondition = shm_broadcast.SpinCondition
# Every method the plugin replaces (``vllm_plugin.register`` under ``SPIN_ENV``; its NIXL
# patch runs only under ``NIXL_DELAY_ENV``, which ``stock`` unsets).
PATCHED = ((SpinCondition, "notify"), (SpinCondition, "__init__"),
           (GPUModelRunner, "sample_tokens"))


class Recorder:
    """Stands in for a socket or poller: forwards every call, and records the calls
    named in ``names`` with their arguments, in order."""

    def __init__(self, target: Any, names: tuple[str, ...]) -> None:
        self._target = target
        self._names = names
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name not in self._names:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            return attr(*args, **kwargs)
        return call


@pytest.fixture
def stock(monkeypatch: pytest.MonkeyPatch) -> dict[str, Callable[..., Any]]:
    """vLLM as it ships: the ``PATCHED`` methods and the recheck interval, the plugin's
    flags unset. Every one is put back after the test (the plugin's patches are
    process-wide: later tests in this process see stock vLLM). The stock methods, by
    ``Class.name``."""
    originals = {}
    for cls, name in PATCHED:
        current = getattr(cls, name)
        original = getattr(current, "__pdserve_original__", current)
        monkeypatch.setattr(cls, name, original)
        originals[f"{cls.__name__}.{name}"] = original
    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", VLLM_RECHECK_MS)
    for env in (vllm_plugin.SPIN_ENV, vllm_plugin.NIXL_DELAY_ENV):
        monkeypatch.delenv(env, raising=False)
    return originals


@pytest.fixture
def load_plugin(stock: object) -> Callable[[], None]:
    """pdserve's general plugin, found by its entry point and run, as vLLM does; what it
    patches is undone after the test (``stock``)."""
    return load_plugins_by_group("vllm.general_plugins")["pdserve"]


@pytest.fixture
def pair(stock: object) -> Iterator[tuple[Any, Any]]:
    """A writer and a non-spinning reader as vLLM makes them, each in its own context
    (as in two processes), the reader subscribed."""
    contexts = (zmq.Context(), zmq.Context())
    addr = get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=contexts[0], notify_address=addr)
    reader = SpinCondition(is_reader=True, context=contexts[1], notify_address=addr,
                           busy_loop_s=0)
    deadline = time.monotonic() + HANG_MS / 1000
    while not reader.local_notify_socket.poll(20):  # a SUB hears nothing until joined
        assert time.monotonic() < deadline, "the reader never subscribed"
        writer.local_notify_socket.send(b"\x00")
    reader.local_notify_socket.recv()
    try:
        yield writer, reader
    finally:
        for ctx in contexts:
            ctx.destroy(linger=0)
        Path(addr.removeprefix("ipc://")).unlink(missing_ok=True)  # zmq leaves the file


def lost_second_pings(writer: Any, reader: Any) -> int:
    """Rounds in which the reader, woken by one ping, never got the very next one; stops
    at the first such round (a dropped ping is gone: waiting longer cannot bring it)."""
    for _ in range(ROUNDS):
        time.sleep(0.005)  # an engine step apart
        writer.notify()
        assert reader.local_notify_socket.poll(HANG_MS), "the first ping never came"
        reader.local_notify_socket.recv(zmq.NOBLOCK)
        writer.notify()  # the next message, while the reader waits for it
        if not reader.local_notify_socket.poll(HANG_MS):
            return 1
        reader.local_notify_socket.recv(zmq.NOBLOCK)
    return 0


def test_without_the_flag_vllm_is_left_as_it_is(
        stock: dict[str, Callable[..., Any]], load_plugin: Callable[[], None]) -> None:
    """A plain ``vllm serve`` in the same environment loads the plugin too: untouched."""
    load_plugin()
    assert {f"{cls.__name__}.{name}": getattr(cls, name) for cls, name in PATCHED} == stock
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == VLLM_RECHECK_MS


def test_the_flag_patches_the_writer_the_reader_and_the_recheck_once(
        stock: dict[str, Callable[..., Any]], load_plugin: Callable[[], None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_plugin.SPIN_ENV, "0")
    load_plugin()
    load_plugin()  # vLLM may load plugins twice: no double wrapping
    wrapped = {f"{cls.__name__}.{name}": getattr(getattr(cls, name), "__pdserve_original__",
                                                 None) for cls, name in PATCHED}
    # sample_tokens (the seeded partial prefills' fix) is patched on a CPU platform only.
    cpu = current_platform.is_cpu()
    assert wrapped == {key: original if cpu or key.startswith("SpinCondition.") else None
                       for key, original in stock.items()}
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == vllm_plugin.RECHECK_MS


def test_the_patched_writer_runs_its_mailbox_right_before_each_ping(
        pair: tuple[Any, Any], load_plugin: Callable[[], None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fix itself: ``getsockopt(EVENTS)`` credits the ping the reader took, then the
    ping goes out (and arrives)."""
    monkeypatch.setenv(vllm_plugin.SPIN_ENV, "0")
    load_plugin()
    writer, reader = pair
    socket = Recorder(writer.local_notify_socket, ("getsockopt", "send"))
    writer.local_notify_socket = socket
    writer.notify()
    writer.notify()
    ping: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        ("getsockopt", (zmq.EVENTS,), {}), ("send", (b"\x00",), {})]
    assert socket.calls == ping + ping
    assert reader.local_notify_socket.poll(HANG_MS), "the ping never came"


def test_the_patched_writer_never_drops_a_ping(pair: tuple[Any, Any],
                                               load_plugin: Callable[[], None],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_plugin.SPIN_ENV, "0")
    load_plugin()
    assert lost_second_pings(*pair) == 0


@pytest.mark.parametrize("should_warn", [False, True])
def test_an_idle_reader_whose_ping_is_lost_looks_again_after_recheck_ms(
        pair: tuple[Any, Any], load_plugin: Callable[[], None],
        monkeypatch: pytest.MonkeyPatch, should_warn: bool) -> None:
    """No ping comes (the one that went missing): the reader sleeps ``RECHECK_MS``,
    not vLLM's 5 s, and returns to look at its queue."""
    monkeypatch.setenv(vllm_plugin.SPIN_ENV, "0")
    load_plugin()
    _, reader = pair
    poller = Recorder(reader.poller, ("poll",))
    reader.poller = poller
    timeout = shm_broadcast.MessageQueue.ReadTimeoutWithWarnings(None, should_warn)
    reader.wait(timeout_ms=timeout.timeout_ms())
    assert poller.calls == [("poll", (), {"timeout": vllm_plugin.RECHECK_MS})]


def test_the_recheck_is_capped_never_raised(load_plugin: Callable[[], None],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", 20)
    monkeypatch.setenv(vllm_plugin.SPIN_ENV, "0")
    load_plugin()
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 20

UCX_RCACHE_ENV = "UCX_RCACHE_MAX_UNRELEASED"  # the NIXL tweak sets it, as vLLM would


@pytest.fixture
def stock_nixl(stock: object) -> Iterator[None]:
    """NIXL's modules and agent config as installed, and UCX's environment, put back
    after the test (the NIXL tweak replaces the config class, process-wide)."""
    ucx_env = os.environ.get(UCX_RCACHE_ENV)
    modules = {k: v for k, v in sys.modules.items() if k == "nixl" or k.startswith("nixl.")}
    yield
    api = sys.modules.get("nixl._api")
    if api is not None:
        config = api.nixlBind.nixlAgentConfig
        api.nixlBind.nixlAgentConfig = getattr(config, "__pdserve_base__", config)
    for name in [k for k in sys.modules if k == "nixl" or k.startswith("nixl.")]:
        if name not in modules:
            del sys.modules[name]
    sys.modules.update(modules)
    if ucx_env is None:
        os.environ.pop(UCX_RCACHE_ENV, None)
    else:
        os.environ[UCX_RCACHE_ENV] = ucx_env


def test_the_nixl_tweak_gives_progress_threads_a_poll_delay_once(
        stock_nixl: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``PDSERVE_NIXL_PROGRESS_DELAY_US`` (bench compare's vLLM P/D baseline on CPU),
    a NIXL agent asking for a busy progress thread (``pthrDelay = 0``) gets the delay."""
    monkeypatch.setenv(vllm_plugin.NIXL_DELAY_ENV, "1000")
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may load plugins twice: the delay must not stack
    import nixl._api as api

    config = api.nixlBind.nixlAgentConfig()
    config.pthrDelay = 0  # what nixl_agent sets
    assert config.pthrDelay == 1000
    config.pthrDelay = 5  # any other value is left alone
    assert config.pthrDelay == 5
