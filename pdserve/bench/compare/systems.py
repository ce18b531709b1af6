"""The systems ``pdserve bench compare`` puts side by side, as command lines.

Every system gets the same engine settings (``EngineSettings``: model, dtype, KV
size, max-model-len, eager, batch cap) and the same cores; only how the engines are
arranged differs:

- ``vllm-tuned``: one aggregated ``vllm serve`` with its compute threads on every core
  and the tuning pdserve's engines get: no shared-memory spin (pdserve's vLLM plugin,
  with its wake-up fix) and the same per-step prefill cap. The baseline of every ratio.
- ``vllm``: the same, stock (vLLM spins its readers 1 s after each message, no cap).
- ``vllm-disagg``: vLLM's own P/D: a prefill and a decode ``vllm serve`` with the
  NixlConnector (prefill on the first half of the cores, decode on the rest, like
  ``pdserve up --cpu-layout split``) behind vLLM's own P/D router (``vllm-router``,
  round robin), or ``pdserve bench disagg-proxy`` (``pdserve.bench.compare.disagg_proxy``) where
  it is not installed.
- ``pdserve``: ``pdserve up`` with the user's flags.
- ``vllm-external`` (``--vllm-url``): a vLLM OpenAI server already running at a URL, in
  place of ``vllm-tuned`` as the baseline: no process, so nothing to start or stop; its
  engine settings are its operator's (``pdserve.bench.compare.external``).

Building a spec starts nothing (the unit tests check these command lines). pdserve's own
processes (``pdserve up``, the proxy) run as ``command`` says: the CLI passes how it was
itself started; the default is the ``pdserve`` command beside this interpreter.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.launch.cpu_layout import core_sets

# Flags compare owns for every system; a --pdserve entry may not set them.
OWNED_UP_FLAGS = ("--model", "--dtype", "--kv-cache-gib", "--max-model-len", "--host",
                  "--port", "--num-kv-blocks")
# pdserve's own engines run at most this many sequences at once (EngineConfig.max_num_seqs);
# vLLM gets the same cap so batches are alike.
MAX_NUM_SEQS = 64
# NIXL's progress thread polls with this delay in vLLM's engines instead of spinning a
# core (pdserve's vLLM plugin; see pdserve/worker/vllm/plugin.py).
NIXL_DELAY_ENV = "PDSERVE_NIXL_PROGRESS_DELAY_US"
NIXL_DELAY_US = 1000


def pdserve_command() -> tuple[str, ...]:
    """The ``pdserve`` command installed beside this interpreter (else on ``PATH``)."""
    script = Path(sys.executable).with_name("pdserve")
    return (str(script) if script.is_file() else shutil.which("pdserve") or "pdserve",)


@dataclass(frozen=True)
class EngineSettings:
    """What every system's engines share."""

    model_path: str
    served_name: str
    dtype: str  # resolved: never "auto", so every system runs the same one
    kv_cache_gib: int
    max_model_len: int
    cores: tuple[int, ...]
    enforce_eager: bool = True  # pdserve up's workers are always eager
    # KV blocks of every engine that computes prompts (aggregated vLLM, vLLM's and
    # pdserve's prefill; overrides kv_cache_gib there): a cache a working set exceeds.
    num_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            raise ValueError("resolve dtype 'auto' before building systems")
        if self.kv_cache_gib <= 0 or self.max_model_len < 16:
            raise ValueError("need kv_cache_gib > 0 and max_model_len >= 16")
        if not self.cores:
            raise ValueError("need at least one core")

    @property
    def all_cores(self) -> str:
        return ",".join(map(str, self.cores))


@dataclass(frozen=True)
class ProcSpec:
    """One process of a system: its argv and the variables added to the environment."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SystemSpec:
    """A system as compare starts it; clients talk to ``port`` on 127.0.0.1, or to
    ``url`` for an external one (running already: compare starts and stops nothing)."""

    name: str
    kind: str  # "vllm" | "vllm-disagg" | "pdserve" | "vllm-external"
    port: int
    procs: tuple[ProcSpec, ...]
    cores: dict[str, str]  # role -> cores its compute threads run on
    flags: str = ""  # the user's pdserve up flags
    url: str | None = None  # an external system's base URL
    card: dict[str, Any] = field(default_factory=dict)  # its /v1/models entry

    @property
    def external(self) -> bool:
        return self.url is not None

    @property
    def base_url(self) -> str:
        return self.url if self.url is not None else f"http://127.0.0.1:{self.port}"

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "kind": self.kind, "flags": self.flags,
                "cores": self.cores, "port": self.port, "external": self.external,
                "url": self.base_url, **({"card": self.card} if self.external else {}),
                "procs": [{"name": p.name, "argv": list(p.argv), "env": p.env}
                          for p in self.procs]}


def _vllm_argv(s: EngineSettings, port: int, prefills: bool = True) -> list[str]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", s.model_path, "--served-model-name", s.served_name,
            "--dtype", s.dtype, "--max-model-len", str(s.max_model_len),
            "--max-num-seqs", str(MAX_NUM_SEQS), "--host", "127.0.0.1", "--port", str(port),
            # usage.prompt_tokens_details.cached_tokens, as pdserve's router reports it
            "--enable-prompt-tokens-details"]
    if prefills and s.num_kv_blocks:
        argv += ["--num-gpu-blocks-override", str(s.num_kv_blocks)]
    return argv + (["--enforce-eager"] if s.enforce_eager else [])


def _vllm_env(s: EngineSettings, cores: str) -> dict[str, str]:
    return {"VLLM_CPU_KVCACHE_SPACE": str(s.kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": cores,
            "HF_HUB_OFFLINE": "1"}


def vllm_aggregated(s: EngineSettings, port: int, name: str = "vllm", tuned: bool = False
                    ) -> SystemSpec:
    """One ``vllm serve`` on every core; ``tuned``: as pdserve tunes its own engines."""
    argv, env = _vllm_argv(s, port), _vllm_env(s, s.all_cores)
    if tuned:
        from pdserve.worker.config import prefill_chunk_default
        from pdserve.worker.vllm.plugin import SPIN_ENV

        argv += ["--long-prefill-token-threshold", str(prefill_chunk_default(None))]
        env[SPIN_ENV] = "0"
    proc = ProcSpec("vllm", tuple(argv), env)
    return SystemSpec(name, "vllm", port, (proc,), {"engine": s.all_cores},
                      "tuned" if tuned else "")


def vllm_external(url: str, port: int, card: dict[str, Any],
                  name: str = "vllm-external") -> SystemSpec:
    """The vLLM server running at ``url`` (``port``: the one it names), whose
    ``/v1/models`` entry is ``card``: no process; its cores are not known."""
    return SystemSpec(name, "vllm-external", port, (), {"external": "unknown"},
                      url=url, card=dict(card))


def vllm_disagg(s: EngineSettings, port: int, engine_ports: tuple[int, int],
                side_ports: tuple[int, int], name: str = "vllm-disagg",
                command: Sequence[str] | None = None) -> SystemSpec:
    """Two ``vllm serve`` with the NixlConnector (prefill, decode on separate cores;
    UCX over tcp/shared memory, KV read from host memory) and
    the proxy that sends each request to prefill (1 token) then to decode (``command``:
    how to run ``pdserve``, for its ``bench disagg-proxy``)."""
    if len(s.cores) < 2:
        raise ValueError("vLLM disaggregated serving needs 2+ cores (prefill and decode "
                         "on separate cores)")
    half = len(s.cores) // 2  # as pdserve up --cpu-layout split places one of each
    p_cores, d_cores = (",".join(map(str, c)) for c in (s.cores[:half], s.cores[half:]))
    procs = []
    for role, eport, side, cores in (("prefill", engine_ports[0], side_ports[0], p_cores),
                                     ("decode", engine_ports[1], side_ports[1], d_cores)):
        # vLLM 0.32 deprecates kv_both for the NixlConnector: producer prefills, consumer decodes
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        kv = {"kv_connector": "NixlConnector", "kv_role": kv_role,
              "kv_buffer_device": "cpu", "kv_connector_extra_config": {"backends": ["UCX"]}}
        env = dict(_vllm_env(s, cores), VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                   VLLM_NIXL_SIDE_CHANNEL_PORT=str(side), UCX_TLS="tcp,self,sm",
                   **{NIXL_DELAY_ENV: str(NIXL_DELAY_US)})
        argv = _vllm_argv(s, eport, role == "prefill") + ["--kv-transfer-config", json.dumps(kv)]
        procs.append(ProcSpec(role, tuple(argv), env))
    prefill_url, decode_url = (f"http://127.0.0.1:{p}" for p in engine_ports)
    if has_vllm_router():
        proxy = [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation",
                 "--prefill", prefill_url, "--decode", decode_url, "--policy", "round_robin",
                 "--host", "127.0.0.1", "--port", str(port), "--request-timeout-secs", "1800",
                 "--max-concurrent-requests", "1024", "--queue-size", "1024"]
        procs.append(ProcSpec("vllm-router", tuple(proxy)))
    else:
        # Its address given, not left to PDSERVE_HOST (a deployment's bind address).
        proxy = [*(command or pdserve_command()), "bench", "disagg-proxy", "--host", "127.0.0.1",
                 "--port", str(port), "--prefill", prefill_url, "--decode", decode_url]
        procs.append(ProcSpec("proxy", tuple(proxy)))
    return SystemSpec(name, "vllm-disagg", port, tuple(procs),
                      {"prefill": p_cores, "decode": d_cores})


def has_vllm_router() -> bool:
    """vLLM's own P/D router (``pip install vllm-router``) is installed."""
    import importlib.util

    return importlib.util.find_spec("vllm_router") is not None


def parse_pdserve_entry(entry: str) -> tuple[str, str]:
    """``NAME=FLAGS`` (``--pdserve``) -> (name, flags); flags compare owns are refused."""
    name, sep, flags = entry.partition("=")
    name = name.strip()
    if not sep or not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"--pdserve {entry!r}: expected NAME='<pdserve up flags>' with NAME "
                         "made of letters, digits, '-', '_' or '.'")
    try:
        words = shlex.split(flags)
    except ValueError as exc:
        raise ValueError(f"--pdserve {entry!r}: {exc}") from exc
    owned = [w for w in words if w.split("=", 1)[0] in OWNED_UP_FLAGS]
    if owned:
        raise ValueError(f"--pdserve {name}: {', '.join(owned)} is set by compare for every "
                         f"system (owned: {', '.join(OWNED_UP_FLAGS)})")
    return name, flags


def pdserve_up(s: EngineSettings, port: int, name: str, flags: str,
               command: Sequence[str] | None = None) -> SystemSpec:
    """``pdserve up`` with the shared engine settings plus the user's flags; ``command``:
    how to run ``pdserve`` (default: ``pdserve_command()``)."""
    argv = [*(command or pdserve_command()), "up", "--model", s.model_path,
            "--dtype", s.dtype, "--kv-cache-gib", str(s.kv_cache_gib),
            "--max-model-len", str(s.max_model_len), "--host", "127.0.0.1",
            "--port", str(port),
            # up gives them to its prefill workers
            *(["--num-kv-blocks", str(s.num_kv_blocks)] if s.num_kv_blocks else []),
            *shlex.split(flags)]
    env = {"HF_HUB_OFFLINE": "1"}
    layout = _layout_of(flags)
    if "--simulated" in shlex.split(flags):
        cores = {"simulated": "none"}
    else:
        p, d = core_sets(1, 1, layout)
        cores = {"prefill": p[0] or s.all_cores, "decode": d[0] or s.all_cores}
    return SystemSpec(name, "pdserve", port, (ProcSpec("pdserve-up", tuple(argv), env),),
                      cores, flags)


def _layout_of(flags: str) -> str:
    words = shlex.split(flags)
    for i, w in enumerate(words):
        if w == "--cpu-layout" and i + 1 < len(words):
            return words[i + 1]
        if w.startswith("--cpu-layout="):
            return w.split("=", 1)[1]
    return "auto"
