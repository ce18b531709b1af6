"""``pdserve up``: router + prefill + decode workers on one machine, static membership.

Each component is a child process in its own session (so its vLLM engine
processes go with it); Ctrl-C / SIGTERM stops every child, SIGKILL after a grace
period. Logs go to one file per component; startup shows progress and the
endpoint is printed only once every worker and the router are healthy.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from pdserve.cpu_layout import CPU_LAYOUTS, DEFAULT_CPU_LAYOUT, core_sets, resolve_layout
from pdserve.kv_transfer.base import transport_names
from pdserve.membership.local_etcd import LocalEtcd
from pdserve.model import ResolvedModel, cache_dir
from pdserve.ports import free_port
from pdserve.router.disagg import DisaggConfig
from pdserve.router.edge_config import EdgeConfig
from pdserve.router.worker_client import WorkerCallError, probe_health

_STOP_GRACE_S = 15.0
console = Console(stderr=True)


@dataclass(frozen=True)
class UpConfig:
    model: str
    dtype: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    num_prefill: int = 1
    num_decode: int = 1
    transport: str = "tcp"
    max_model_len: int = 4096
    kv_cache_gib: int = 2
    placement: str = "cache_aware"
    startup_timeout_s: float = 600.0
    log_level: str = "INFO"
    log_format: str = "text"
    cpu_layout: str = DEFAULT_CPU_LAYOUT
    kv_push: bool | None = None  # None: each worker's default (push on CUDA only)
    kv_checksum: bool = False
    kv_throttle_mib_s: float = 0.0
    # Membership: static (default), an etcd at ``etcd``, or a local one (``with_etcd``).
    etcd: str = ""
    with_etcd: bool = False
    cluster: str = "default"
    etcd_ttl_s: int = 10
    num_kv_blocks: int | None = None  # prefill workers' KV blocks (overrides kv_cache_gib)
    disagg: DisaggConfig = DisaggConfig()  # handed to the router as its flags
    edge: EdgeConfig = EdgeConfig()  # the router's too (its keys in its environment)

    def __post_init__(self) -> None:
        if self.etcd and self.with_etcd:
            raise ValueError("give --etcd URL or --with-etcd, not both")
        if self.num_decode < 1 or self.num_prefill < 0:
            raise ValueError("need --num-decode >= 1 and --num-prefill >= 0")
        if self.cpu_layout not in CPU_LAYOUTS:
            raise ValueError(f"cpu_layout must be one of {', '.join(CPU_LAYOUTS)}")
        if self.transport not in transport_names():
            raise ValueError(f"unknown KV transport {self.transport!r}; valid transports: "
                             f"{', '.join(transport_names())}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, model: ResolvedModel) -> UpConfig:
        """From the ``up`` subcommand's flags."""
        return cls(
            model=str(model.path), dtype=args.dtype, host=args.host, port=args.port,
            num_prefill=args.num_prefill, num_decode=args.num_decode,
            transport=args.transport, max_model_len=args.max_model_len,
            kv_cache_gib=args.kv_cache_gib, placement=args.placement,
            startup_timeout_s=args.startup_timeout_s, log_level=args.log_level,
            log_format=args.log_format,
            cpu_layout=args.cpu_layout, kv_checksum=args.kv_checksum,
            kv_throttle_mib_s=args.kv_throttle_mib_s, kv_push=args.kv_push,
            etcd=args.etcd or "", with_etcd=args.with_etcd, cluster=args.cluster,
            etcd_ttl_s=args.etcd_ttl_s, num_kv_blocks=args.num_kv_blocks or None,
            disagg=DisaggConfig.from_args(args), edge=EdgeConfig.from_args(args),
        )


@dataclass
class Child:
    name: str
    argv: list[str]
    log: Path
    probe: str  # "grpc:host:port", "http://.../health" or "http://.../workers" (all routable)
    proc: subprocess.Popen[bytes] | None = None
    state: str = "starting"
    extra: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # added to the child's environment
    probe_headers: dict[str, str] = field(default_factory=dict)  # the router's API key


def plan(cfg: UpConfig, log_dir: Path) -> list[Child]:
    py = [sys.executable, "-m", "pdserve.cli"]
    common = ["--model", cfg.model, "--max-model-len", str(cfg.max_model_len),
              "--log-level", cfg.log_level, "--log-format", cfg.log_format]
    membership = (["--etcd", cfg.etcd, "--cluster", cfg.cluster, "--etcd-ttl-s",
                   str(cfg.etcd_ttl_s)] if cfg.etcd else [])
    p_cores, d_cores = core_sets(cfg.num_prefill, cfg.num_decode, cfg.cpu_layout)
    children: list[Child] = []
    endpoints: dict[str, list[str]] = {"prefill": [], "decode": []}
    for role, n, cores in (("prefill", cfg.num_prefill, p_cores),
                           ("decode", cfg.num_decode, d_cores)):
        for i in range(n):
            port, kv_port = free_port(), free_port()
            argv = py + [role, *common, "--dtype", cfg.dtype, "--port", str(port),
                         "--kv-port", str(kv_port), "--transport", cfg.transport,
                         "--kv-cache-gib", str(cfg.kv_cache_gib), "--worker-id", f"{role}-{i}",
                         *membership]
            if cores[i]:
                argv += ["--cpu-cores", cores[i]]
            if cfg.kv_push is not None:
                argv += ["--kv-push" if cfg.kv_push else "--no-kv-push"]
            argv += ["--kv-checksum" if cfg.kv_checksum else "--no-kv-checksum",
                     "--kv-throttle-mib-s", str(cfg.kv_throttle_mib_s)]
            if role == "prefill" and cfg.num_kv_blocks:
                argv += ["--num-kv-blocks", str(cfg.num_kv_blocks)]
            endpoints[role].append(f"127.0.0.1:{port}")
            children.append(Child(f"{role}-{i}", argv, log_dir / f"{role}-{i}.log",
                                  f"grpc:127.0.0.1:{port}",
                                  extra={"cores": cores[i]} if cores[i] else {}))
    workers = membership or ["--prefill", ",".join(endpoints["prefill"]),
                             "--decode", ",".join(endpoints["decode"])]
    router_argv = py + ["router", *common, "--host", cfg.host, "--port", str(cfg.port),
                        *workers, "--placement", cfg.placement, *cfg.disagg.flags(),
                        *cfg.edge.flags()]
    probe_host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    # Ready once the router itself sees every worker healthy: a worker's own Health
    # turns ready up to one router health interval before the router places on it,
    # and a request in between would skip a prefill worker that is up.
    children.append(Child("router", router_argv, log_dir / "router.log",
                          f"http://{probe_host}:{cfg.port}/workers",
                          extra={"num_workers": str(cfg.num_prefill + cfg.num_decode)},
                          env=cfg.edge.env(), probe_headers=cfg.edge.probe_headers()))
    return children


def _healthy(child: Child) -> bool:
    if child.probe.startswith("grpc:"):
        target = child.probe.removeprefix("grpc:")
        try:
            health = probe_health(target, timeout_s=1)
        except WorkerCallError:
            return False
        child.state = "ready" if health.ready else "loading engine"
        return bool(health.ready)
    try:
        reply = httpx.get(child.probe, timeout=1, headers=child.probe_headers)
        ok = reply.status_code == 200
        if ok and child.probe.endswith("/workers"):  # every worker found and healthy
            healthy = sum(1 for w in reply.json()["workers"] if w["healthy"])
            ok = healthy >= int(child.extra["num_workers"])
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    child.state = "ready" if ok else "waiting for workers"
    return ok


def _table(children: list[Child], started: float) -> Table:
    table = Table(title=f"pdserve starting ({time.monotonic() - started:.0f}s)")
    table.add_column("component")
    table.add_column("state")
    table.add_column("log")
    for c in children:
        table.add_row(c.name, c.state, str(c.log))
    return table


def start_children(children: list[Child]) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    for child in children:
        child.log.parent.mkdir(parents=True, exist_ok=True)
        with open(child.log, "wb") as log:
            child.proc = subprocess.Popen(child.argv, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env={**env, **child.env},
                                          start_new_session=True)


def stop_children(children: list[Child], grace_s: float = _STOP_GRACE_S) -> None:
    """SIGTERM every child's process group, then SIGKILL what is left after ``grace_s``."""
    live = [c for c in children if c.proc is not None]
    for c in reversed(live):  # router first: no new requests while workers drain
        _signal_group(c, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in live:
        assert c.proc is not None
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for c in live:
        _signal_group(c, signal.SIGKILL)  # the group: engine processes included
        assert c.proc is not None
        c.proc.wait(timeout=10)


def _signal_group(child: Child, sig: int) -> None:
    assert child.proc is not None
    try:
        os.killpg(child.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_ready(children: list[Child], timeout_s: float) -> None:
    started = time.monotonic()
    with Live(_table(children, started), console=console, refresh_per_second=2) as live:
        while True:
            for child in children:
                assert child.proc is not None
                if child.proc.poll() is not None:
                    child.state = f"exited ({child.proc.returncode})"
                    live.update(_table(children, started))
                    raise RuntimeError(f"{child.name} exited during startup; see {child.log}:\n"
                                       + _tail(child.log))
                if child.state != "ready":
                    _healthy(child)
            live.update(_table(children, started))
            if all(c.state == "ready" for c in children):
                return
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"not ready after {timeout_s:.0f}s")
            time.sleep(0.5)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_up(cfg: UpConfig) -> int:
    log_dir = cache_dir() / "logs" / time.strftime("%Y%m%d-%H%M%S")
    etcd: LocalEtcd | None = None
    if cfg.with_etcd:
        log_dir.mkdir(parents=True, exist_ok=True)
        etcd = LocalEtcd(log_path=log_dir / "etcd.log").start()  # fails clearly without one
        console.print(f"local etcd at {etcd.url} (data {etcd.data_dir})")
        cfg = replace(cfg, etcd=etcd.url, with_etcd=False)
    try:
        return _run_children(cfg, log_dir)
    finally:
        if etcd is not None:
            etcd.stop()


def _print_layout(cfg: UpConfig, children: list[Child]) -> None:
    """Say which cores each engine got, and why (``--cpu-layout auto``: measured under
    load, see ``pdserve/cpu_layout.py``)."""
    layout = resolve_layout(cfg.cpu_layout)
    why = " (auto: split measured best under load)" if cfg.cpu_layout == "auto" else ""
    cores = ", ".join(f"{c.name} on {c.extra['cores']}" for c in children if "cores" in c.extra)
    if cores:
        console.print(f"cpu layout {layout}{why}: {cores}")


def _run_children(cfg: UpConfig, log_dir: Path) -> int:
    children = plan(cfg, log_dir)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        _print_layout(cfg, children)
        start_children(children)
        wait_ready(children, cfg.startup_timeout_s)
        console.print(f"[bold green]pdserve ready[/]: http://{cfg.host}:{cfg.port}/v1  "
                      f"(model {Path(cfg.model).name}, logs {log_dir})")
        print(f"http://{cfg.host}:{cfg.port}/v1", flush=True)
        while True:
            for child in children:
                assert child.proc is not None
                if child.proc.poll() is not None:
                    console.print(f"[red]{child.name} exited ({child.proc.returncode})[/]; "
                                  f"stopping. Log: {child.log}\n{_tail(child.log)}")
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("stopping pdserve...")
        return 0
    except RuntimeError as exc:
        console.print(f"[red]pdserve failed to start[/]: {exc}")
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_children(children)
