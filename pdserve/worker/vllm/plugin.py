"""pdserve's vLLM general plugin: loaded by vLLM itself in every engine process
(EngineCore and each Worker) before their message queues exist.

It tunes vLLM's shared-memory queues, and only where pdserve's engine host asked for it
through ``SPIN_ENV`` (so an aggregated ``vllm serve`` in the same environment is
untouched): how long a reader busy-waits after each read, and that a writer's wake-up
ping is never lost.

vLLM's ``SpinCondition`` makes the EngineCore (waiting for the Worker's output) and
the Worker (waiting for the next scheduler output) ``sched_yield`` in a loop for 1 s
after every message before they sleep on a socket. With dedicated cores that saves
microseconds per step. On a CPU host the engine's compute threads own the cores: two
spinning readers per engine, and two engines per host with P/D, steal them from the
very step they wait for. Measured here (2 cores, both engines on both): one
~10-token request's prefill-to-decode gap went from 1.05-1.15 s to 0.11-0.14 s with
the spin off, and 16 tokens from 2.5-2.8 s to 1.6-1.8 s (one aggregated engine: 1.49 s).

A reader that does not spin waits on the writer's ZMQ ping, and vLLM's pings get lost:
the writer's PUB socket has ``SNDHWM=1``, and libzmq learns that the subscriber took the
previous ping only when the socket processes its command mailbox, which ``send`` does
at most once per ``max_command_delay`` (3M TSC cycles, ~1 ms). So a ping sent within
~1 ms of the previous one is dropped even when the reader already received that one
(measured: 298 of 300 such second pings lost, 0 of 300 with the fix below; every CPU
runs the same libzmq rule). The Worker answers ``execute_model`` then ``sample_tokens``
that close together on a fast CPU, and the EngineCore, woken by the first answer, then
sleeps until vLLM's 5 s recheck (``SHM_READER_RECHECK_INTERVAL_MS``): the 5.05 s
stalls seen on an AMD EPYC with native bf16. ``reliable_notify`` has the writer process
its mailbox (``getsockopt(EVENTS)``) right before each ping, so a ping is dropped only
while the previous one is still queued on the writer's side, i.e. not yet seen by the
reader, which it will still wake.

As a bound on whatever wake-up might still go missing (the I/O thread may hold a ping
it has taken from the pipe but not yet credited), ``reliable_notify`` also caps the
idle reader's recheck (``SHM_READER_RECHECK_INTERVAL_MS``, 5 s in vLLM) at
``RECHECK_MS``: a lost ping then costs at most that, never 5 s. An idle reader wakes
~10 times a second to look at its queue: microseconds of CPU.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

# Under "vllm": the engine processes configure only vLLM's loggers.
logger = logging.getLogger("vllm.pdserve_plugin")

# Seconds a shared-memory queue reader spins after a read; unset: vLLM's own (1 s).
SPIN_ENV = "PDSERVE_VLLM_SHM_SPIN_S"
# Microseconds NIXL's progress thread (vLLM's NixlConnector) waits between polls; unset: 0.
NIXL_DELAY_ENV = "PDSERVE_NIXL_PROGRESS_DELAY_US"
# The longest an idle shared-memory reader sleeps before it looks at its queue again.
RECHECK_MS = 100


def _original(cls: type, name: str) -> Callable[..., Any]:
    """``cls.<name>`` as vLLM defined it, not a wrapper of ours from an earlier call."""
    method = getattr(cls, name)
    return getattr(method, "__pdserve_original__", method)


def _patch(cls: type, name: str, original: Callable[..., Any],
           wrapper: Callable[..., Any]) -> None:
    """``wrapper`` (of ``original``) in place of ``cls.<name>``; a later patch wraps
    ``original`` again, never ``wrapper``."""
    vars(wrapper)["__pdserve_original__"] = original
    setattr(cls, name, wrapper)


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (may run more than once per process)."""
    register_gloo_transfer()
    delay = os.environ.get(NIXL_DELAY_ENV)
    if delay is not None:
        if delay.isdigit():
            nixl_progress_delay(int(delay))
        else:
            logger.warning("ignoring %s=%r: not a number of microseconds", NIXL_DELAY_ENV,
                           delay)
    raw = os.environ.get(SPIN_ENV)
    if raw is None:
        return
    try:
        spin_s = float(raw)
    except ValueError:
        logger.warning("ignoring %s=%r: not a number of seconds", SPIN_ENV, raw)
        return
    set_shm_spin(spin_s)
    reliable_notify()
    seeded_partial_prefills()


def register_gloo_transfer() -> None:
    """The ``gloo`` weight-transfer backend (``gloo_transfer.py``: a trainer's tensors
    into a CPU engine) in vLLM's registry, imported only by an engine configured for it;
    a name vLLM's own backends do not take, so other engines are untouched."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            "gloo", "pdserve.worker.vllm.gloo_transfer", "GlooWeightTransferEngine")
    except ValueError:  # registered by an earlier call in this process
        pass


def reliable_notify() -> None:
    """Every ``SpinCondition`` writer processes its socket's pending commands before it
    pings, so a ping the reader may need is never dropped, and an idle reader rechecks
    its queue every ``RECHECK_MS`` at the latest (module docstring)."""
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast

    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = min(
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, RECHECK_MS)

    cls = shm_broadcast.SpinCondition
    original = _original(cls, "notify")

    @functools.wraps(original)
    def notify(self: Any) -> None:
        # ZMQ_EVENTS runs the socket's command mailbox unthrottled: the subscriber's
        # "took the previous ping" (activate_write) lands before this send checks HWM.
        self.local_notify_socket.getsockopt(zmq.EVENTS)
        original(self)

    _patch(cls, "notify", original, notify)


def seeded_partial_prefills() -> None:
    """On CPU, a seeded request whose prompt is computed over several steps no longer
    kills the engine (engine processes pdserve started only, like the rest of this
    plugin).

    vLLM samples a token for every request each step and discards the one of a request
    still in its prefill (a chunk of its prompt); for a seeded request it then rewinds
    the request's generator (``gen.set_offset(gen.get_offset() - 4)``), which a CPU
    generator refuses: ``RuntimeError: CPU Generator does not use offset``, the engine
    dead. One client request with a ``seed`` and a prompt long enough to be chunked
    beside other streams (RL rollouts send seeds) took a worker down. While a step's
    tokens are sampled, the generators of the requests whose tokens will be discarded
    are set aside: those rows sample from the global generator (a token nobody sees),
    their own generators draw nothing, which is what vLLM's rewind achieves on GPUs. So
    a seeded request's tokens do not depend on how its prompt was chunked."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    cls = GPUModelRunner
    original = _original(cls, "sample_tokens")

    @functools.wraps(original)
    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        batch = self.input_batch
        held: dict[int, Any] = {}
        if batch.generators and self.execute_model_state is not None:
            for i in self.discard_request_mask.np[:batch.num_reqs].nonzero()[0]:
                generator = batch.generators.pop(int(i), None)
                if generator is not None:
                    held[int(i)] = generator
        try:
            return original(self, grammar_output)
        finally:
            batch.generators.update(held)

    _patch(cls, "sample_tokens", original, sample_tokens)


def set_shm_spin(spin_s: float) -> None:
    """Every ``SpinCondition`` reader made from now on spins ``spin_s`` seconds."""
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    original = _original(cls, "__init__")

    @functools.wraps(original)
    def init(self: Any, is_reader: bool, context: Any, notify_address: str,
             busy_loop_s: float = spin_s) -> None:
        original(self, is_reader, context, notify_address, busy_loop_s)
        if is_reader:
            self.busy_loop_s = spin_s

    _patch(cls, "__init__", original, init)
    logger.info("pdserve: vLLM shared-memory readers in pid %d spin %.3g s", os.getpid(), spin_s)


def nixl_progress_delay(delay_us: int) -> None:
    """NIXL agents made from now on poll in their progress thread every ``delay_us``.

    NIXL's Python agent runs its progress thread with no delay between polls
    (``pthrDelay = 0``, not configurable through it or vLLM's NixlConnector): on a CPU
    host it busy-spins a core the engine's compute threads need (measured: an idle
    agent burns 0.94 CPU-s/s; 0.02 with a 1 ms delay). Turning the thread off instead
    stalls transfers over UCX's tcp transport: the prefill side's UCX worker then
    progresses only when its engine steps, and an idle engine does not (measured: 18.7 s
    for one transfer, TTFT ~39 s). ``pdserve bench compare --with-vllm-disagg`` asks for
    a delay in vLLM's engines. Also maps ``nixl`` (what vLLM imports) onto the
    ``nixl-cu12`` wheel where the ``nixl`` meta package (which pulls the CUDA 13 wheel
    too) is not installed.
    """
    import importlib
    import sys

    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # as vLLM would set it
    try:
        api = importlib.import_module("nixl._api")
    except ImportError:
        try:
            pkg = importlib.import_module("nixl_cu12")
        except ImportError:
            logger.warning("pdserve: %s set but NIXL is not installed", NIXL_DELAY_ENV)
            return
        sys.modules["nixl"] = pkg
        for sub in ("_bindings", "_utils", "logging", "_api"):
            sys.modules[f"nixl.{sub}"] = importlib.import_module(f"nixl_cu12.{sub}")
        api = sys.modules["nixl._api"]
    bindings = api.nixlBind
    base = getattr(bindings.nixlAgentConfig, "__pdserve_base__", bindings.nixlAgentConfig)

    class AgentConfig(base):  # type: ignore[misc, valid-type]
        __pdserve_base__ = base

        def __setattr__(self, name: str, value: Any) -> None:
            if name == "pthrDelay" and value == 0:
                value = delay_us
            super().__setattr__(name, value)

    bindings.nixlAgentConfig = AgentConfig
    logger.info("pdserve: NIXL progress threads in pid %d poll every %d us", os.getpid(),
                delay_us)
