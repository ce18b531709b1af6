"""``pdserve up``: router + prefill + decode workers on one machine, static membership.

Each component is a child process in its own session (so its vLLM engine
processes go with it), supervised: one that exits is restarted with back-off
while the rest keep serving (``up_watch.py``). Ctrl-C / SIGTERM stops every
child, SIGKILL after a grace period. Logs go to one file per component; startup
shows progress and the endpoint is printed once the cluster can serve.
``--simulated`` starts simulated workers (``sim-worker``: made-up tokens,
modelled times) instead of vLLM ones, for fast router and fault tests.
"""

from __future__ import annotations

import signal
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdserve.core.block_hash import DEFAULT_WEIGHT_VERSION
from pdserve.core.cluster_secret import optional_secret, write_cluster_secret
from pdserve.core.dtype import DtypeChoice
from pdserve.core.grpc_tls import TlsFiles
from pdserve.core.model import new_log_dir
from pdserve.core.ports import free_port, reserve
from pdserve.kv_transfer.base import transport_names
from pdserve.kv_transfer.remote.base import check_store_tls
from pdserve.launch.cpu_layout import CPU_LAYOUTS, DEFAULT_CPU_LAYOUT, core_sets, resolve_layout
from pdserve.launch.supervisor import DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_WINDOW_S, RestartPolicy
from pdserve.launch.up_children import STOP_GRACE_S, Child, console
from pdserve.launch.up_servers import KeptServer, kept_servers
from pdserve.launch.up_store import KvStoreUp, LocalStore
from pdserve.launch.up_targets import METRICS_KEY, scrape_targets, targets_line, write_file_sd
from pdserve.launch.up_watch import ClusterWatch
from pdserve.membership.etcd_client import EtcdAuth, check_etcd_url
from pdserve.membership.local_etcd import LocalEtcd
from pdserve.router.http.edge.config import EdgeConfig
from pdserve.worker.engine import WEIGHT_TRANSFER_BACKENDS

__all__ = ["Child", "UpConfig", "plan", "run_up"]


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
    startup_timeout_s: float = 600.0
    log_level: str = "INFO"
    cpu_layout: str = DEFAULT_CPU_LAYOUT
    kv_disk_dir: str | None = None  # each worker gets its own folder below it
    kv_disk_gib: float = 0.0
    # The cluster KV store (--kv-store*, --kv-compression), or a local one (--with-redis).
    kv_store: KvStoreUp = KvStoreUp()
    # Membership: static (default), an etcd at ``etcd``, or a local one (``with_etcd``).
    etcd: str = ""
    with_etcd: bool = False
    cluster: str = "default"
    etcd_ttl_s: int = 10
    etcd_auth: EtcdAuth = EtcdAuth()  # --etcd-user/--etcd-password-file, for every child
    num_kv_blocks: int | None = None  # prefill workers' (overrides --kv-cache-gib)
    weight_version: str = DEFAULT_WEIGHT_VERSION  # every worker's starting weights'
    weight_transfer_backend: str | None = None  # every vLLM engine's (None: off)
    # The router's flags (--placement, --disagg, --planner*, --max-concurrent-requests,
    # ...: all but its keys and admin listener, ``edge``) as up parsed them, handed on
    # (``pdserve.cli.configs.router_flags``).
    router_flags: tuple[str, ...] = ()
    # Every vLLM worker's engine, transport and LoRA flags that up does not decide itself
    # (--kv-cache-gib, --kv-push, --prefill-order, --enable-lora, ...) as up parsed them,
    # handed on (``pdserve.cli.configs.HANDED_TO_WORKERS``).
    worker_flags: tuple[str, ...] = ()
    # Supervision: a child failing more than max_restarts times within the window is
    # given up on.
    max_restarts: int = DEFAULT_MAX_RESTARTS
    restart_window_s: float = DEFAULT_RESTART_WINDOW_S
    simulated: bool = False  # sim-worker processes instead of vLLM workers
    # The cluster secret's file, handed to every child; None: ``run_up`` makes one.
    cluster_secret_file: str | None = None
    tls: TlsFiles = TlsFiles()  # gRPC TLS files, handed to every child
    log_format: str = "text"
    # The router's keys (handed on in its environment) and admin listener, which up's
    # probes use; its other edge flags are in router_flags.
    edge: EdgeConfig = EdgeConfig()
    worker_metrics: bool = True  # each worker gets a free /metrics port
    metrics_targets_file: str = ""  # Prometheus file_sd JSON, written once ready
    log_dir: str = ""  # every process's log ("": a new folder per run, run_log_dir)
    router_processes: int = 1  # the router's --processes (its scrape target: process 0's)
    # How ``dtype`` was resolved (printed at start-up).
    dtype_choice: DtypeChoice | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.etcd and self.with_etcd:
            raise ValueError("give --etcd URL or --with-etcd, not both")
        if self.etcd:
            check_etcd_url(self.etcd, self.tls)  # --require-tls: https:// only
        if self.kv_store.url:
            check_store_tls(self.kv_store.url, self.tls.required)  # and rediss:// only
        if self.etcd_auth.user and not self.etcd:
            raise ValueError("--etcd-user needs --etcd URL (--with-etcd starts an etcd "
                             "without users)")
        if self.num_decode < 1 or self.num_prefill < 0:
            raise ValueError("need --num-decode >= 1 and --num-prefill >= 0")
        if bool(self.kv_disk_dir) != (self.kv_disk_gib > 0):
            raise ValueError("the disk tier needs both --kv-disk-dir and --kv-disk-gib")
        if self.cpu_layout not in CPU_LAYOUTS:
            raise ValueError(f"cpu_layout must be one of {', '.join(CPU_LAYOUTS)}")
        if self.transport not in transport_names():
            raise ValueError(f"unknown KV transport {self.transport!r}; valid transports: "
                             f"{', '.join(transport_names())}")
        if self.tls.required and self.transport != "tcp" and not self.simulated:
            raise ValueError(f"--require-tls: the {self.transport} transport moves KV bytes "
                             "outside the TLS control channel, unencrypted; use --transport tcp")
        self._check_weights()
        if self.metrics_targets_file and not Path(self.metrics_targets_file).parent.is_dir():
            raise ValueError(f"--metrics-targets-file {self.metrics_targets_file}: no such "
                             "directory")
        optional_secret(self.cluster_secret_file)  # a bad secret file fails before any child
        self.tls.load()

    def _check_weights(self) -> None:
        if not self.weight_version.strip():
            raise ValueError("--weight-version must not be empty")
        if self.weight_transfer_backend not in (None, *WEIGHT_TRANSFER_BACKENDS):
            raise ValueError(f"--weight-transfer-backend must be one of "
                             f"{', '.join(WEIGHT_TRANSFER_BACKENDS)}")
        if self.weight_transfer_backend and self.simulated:
            raise ValueError("--weight-transfer-backend: simulated workers have no "
                             "weight-transfer engine")
        if self.simulated and (self.kv_store.enabled or self.kv_store.compression != "none"):
            raise ValueError("--kv-store, --with-redis, --kv-compression: simulated workers "
                             "have no KV cache to store")

    @property
    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(self.max_restarts, self.restart_window_s)


def plan(cfg: UpConfig, log_dir: Path) -> list[Child]:
    cfg = replace(cfg, edge=probed_edge(cfg.edge))
    py = [sys.executable, "-m", "pdserve.cli.main"]
    common = ["--model", cfg.model, "--max-model-len", str(cfg.max_model_len),
              "--log-level", cfg.log_level, "--log-format", cfg.log_format]
    security = (["--cluster-secret-file", cfg.cluster_secret_file]  # a path: the secret
                if cfg.cluster_secret_file else [])  # itself never shows in `ps`
    security += cfg.tls.flags()  # certificates must name 127.0.0.1, where up probes
    common += security
    membership = (["--etcd", cfg.etcd, "--cluster", cfg.cluster, "--etcd-ttl-s",
                   str(cfg.etcd_ttl_s)] if cfg.etcd else [])
    if cfg.etcd and cfg.etcd_auth.user:  # the password's file, never the password
        membership += ["--etcd-user", cfg.etcd_auth.user,
                       "--etcd-password-file", cfg.etcd_auth.password_file]
    p_cores, d_cores = core_sets(cfg.num_prefill, cfg.num_decode, cfg.cpu_layout)
    # The router's ports, given: no worker may be handed one of them.
    reserve(cfg.port, *(range(cfg.edge.admin_port, cfg.edge.admin_port + cfg.router_processes)
                        if cfg.edge.admin_port else ()))
    children: list[Child] = []
    endpoints: dict[str, list[str]] = {"prefill": [], "decode": []}
    for role, n, cores in (("prefill", cfg.num_prefill, p_cores),
                           ("decode", cfg.num_decode, d_cores)):
        for i in range(n):
            port, kv_port = free_port(), free_port()
            metrics_port = free_port() if cfg.worker_metrics else 0
            core = "" if cfg.simulated else cores[i]
            if cfg.simulated:  # no engine: no cores, KV or engine flags
                argv = py + ["sim-worker", "--role", role, "--port", str(port),
                             "--worker-id", f"{role}-{i}", "--log-level", cfg.log_level,
                             "--log-format", cfg.log_format, "--weight-version",
                             cfg.weight_version, *membership, *security]
            else:
                argv = py + [role, *common, "--dtype", cfg.dtype, "--port", str(port),
                             "--kv-port", str(kv_port), "--transport", cfg.transport,
                             "--worker-id", f"{role}-{i}", *membership, *cfg.worker_flags]
                argv += _engine_flags(cfg, role, core, f"{role}-{i}")
            argv += ["--metrics-port", str(metrics_port)]
            endpoints[role].append(f"127.0.0.1:{port}")
            extra = {"cores": core} if core else {}
            if metrics_port:
                extra[METRICS_KEY] = f"127.0.0.1:{metrics_port}"
            children.append(Child(f"{role}-{i}", argv, log_dir / f"{role}-{i}.log",
                                  f"grpc:127.0.0.1:{port}", extra=extra))
    workers = membership or ["--prefill", ",".join(endpoints["prefill"]),
                             "--decode", ",".join(endpoints["decode"])]
    router_argv = py + ["router", *common, "--host", cfg.host, "--port", str(cfg.port),
                        *workers, *cfg.router_flags, "--admin-host", cfg.edge.admin_host,
                        "--admin-port", str(cfg.edge.admin_port),
                        "--processes", str(cfg.router_processes)]
    probe_host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    # Ready once the router itself sees every worker healthy: a worker's own Health
    # turns ready up to one router health interval before the router places on it,
    # and a request in between would skip a prefill worker that is up.
    views = (f"http://{router_metrics_endpoint(cfg, probe_host).split(',')[0]}/workers"
             if cfg.edge.admin_port else f"http://{probe_host}:{cfg.port}/workers")
    children.append(Child("router", router_argv, log_dir / "router.log", views,
                          extra={"num_workers": str(cfg.num_prefill + cfg.num_decode),
                                 METRICS_KEY: router_metrics_endpoint(cfg, probe_host)},
                          env=cfg.edge.env(), probe_headers=cfg.edge.admin_probe_headers()))
    return children


def probed_edge(edge: EdgeConfig) -> EdgeConfig:
    """The router's edge as up runs it: with API keys the cluster views (which up's
    readiness probe reads) are the admin plane's only, so a router without an admin
    listener gets one on a free loopback port."""
    if edge.api_keys and not edge.admin_port:
        return replace(edge, admin_port=free_port(), admin_host="127.0.0.1")
    return edge


def _engine_flags(cfg: UpConfig, role: str, cores: str, name: str) -> list[str]:
    """What up decides for one vLLM worker: its cores, its disk tier's folder, its
    weights and KV store, prefill's KV blocks (the rest of its flags, as up parsed them:
    ``cfg.worker_flags``)."""
    argv = ["--cpu-cores", cores] if cores else []
    if cfg.kv_disk_dir and cfg.kv_disk_gib:
        argv += ["--kv-disk-dir", str(Path(cfg.kv_disk_dir) / name),
                 "--kv-disk-gib", repr(cfg.kv_disk_gib)]
    argv += ["--weight-version", cfg.weight_version]
    if cfg.weight_transfer_backend:
        argv += ["--weight-transfer-backend", cfg.weight_transfer_backend]
    if role == "prefill" and cfg.num_kv_blocks:
        argv += ["--num-kv-blocks", str(cfg.num_kv_blocks)]
    return argv + cfg.kv_store.flags()


def run_log_dir(chosen: str) -> Path:
    """The run's log folder: ``chosen`` (made if missing), else a new one under
    ``<cache>/logs`` named by the time and made unique (two ups started in one second
    once wrote into the same files)."""
    if not chosen:
        return new_log_dir()
    folder = Path(chosen).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def run_up(cfg: UpConfig) -> int:
    log_dir = run_log_dir(cfg.log_dir)
    etcd: LocalEtcd | None = None
    store: LocalStore | None = None
    own_secret: tempfile.TemporaryDirectory[str] | None = None
    if not cfg.cluster_secret_file:  # this cluster's own, gone with it
        own_secret = tempfile.TemporaryDirectory(prefix="pdserve-up-")
        path = write_cluster_secret(Path(own_secret.name) / "cluster-secret")
        cfg = replace(cfg, cluster_secret_file=str(path))
        console.print(f"cluster secret {path} (tools calling workers: --cluster-secret-file)")
    if cfg.with_etcd:
        # fails clearly without the binary; TLS (client certificates required) whenever up
        # has mutual TLS files
        etcd = LocalEtcd(log_path=log_dir / "etcd.log",
                         tls=cfg.tls if cfg.tls.mutual else None).start()
        console.print(f"local etcd at {etcd.url} (data {etcd.data_dir})")
        cfg = replace(cfg, etcd=etcd.url, with_etcd=False)
    try:
        if cfg.kv_store.with_redis:  # a password of its own unless given one
            # TLS (client certificates required) whenever up has mutual TLS files, as etcd
            store = LocalStore(cfg.kv_store, log_dir,
                               tls=cfg.tls if cfg.tls.mutual else None).start()
            console.print(f"local redis at {store.server.url} (KV store, "
                          f"maxmemory {cfg.kv_store.redis_maxmemory})")
            cfg = replace(cfg, kv_store=store.store)
        servers = kept_servers(cfg.restart_policy.backoff_max_s, etcd, store)
        return _run_children(cfg, log_dir, servers)
    finally:
        if store is not None:
            store.stop()
        if etcd is not None:
            etcd.stop()
        if own_secret is not None:
            own_secret.cleanup()


def _print_layout(cfg: UpConfig, children: list[Child]) -> None:
    """Say which cores each engine got, and why (``--cpu-layout auto``: measured under
    load, see ``pdserve/launch/cpu_layout.py``)."""
    layout = resolve_layout(cfg.cpu_layout)
    why = " (auto: split measured best under load)" if cfg.cpu_layout == "auto" else ""
    cores = ", ".join(f"{c.name} on {c.extra['cores']}" for c in children if "cores" in c.extra)
    if cores:
        console.print(f"cpu layout {layout}{why}: {cores}")


def router_metrics_endpoint(cfg: UpConfig, probe_host: str) -> str:
    """Where the router's full /metrics is: its admin listener if it has one (with keys
    the main port's shows a tenant its own series only); with several router processes,
    each one's admin port (``--admin-port + i``), comma-separated (``up_targets``). Without
    an admin port they share the main port, where each scrape reaches one of them."""
    if cfg.edge.admin_port:
        admin = cfg.edge.admin_bind_host
        host = "127.0.0.1" if admin in ("0.0.0.0", "::") else admin
        return ",".join(f"{host}:{cfg.edge.admin_port + i}"
                        for i in range(cfg.router_processes))
    return f"{probe_host}:{cfg.port}"


def _announce_targets(cfg: UpConfig, children: list[Child]) -> None:
    """Print the scrape targets after the endpoint line (never starting with http://:
    tools take the first such line as the endpoint), and write them as file_sd JSON."""
    targets = scrape_targets(children)
    print(targets_line(targets), flush=True)
    if cfg.metrics_targets_file:
        path = write_file_sd(Path(cfg.metrics_targets_file), targets)
        console.print(f"scrape targets (Prometheus file_sd) in {path}")


def _run_children(cfg: UpConfig, log_dir: Path, servers: list[KeptServer]) -> int:
    watch = ClusterWatch(plan(cfg, log_dir), cfg.restart_policy, servers,
                         optional_secret(cfg.cluster_secret_file), cfg.tls.load())
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if cfg.dtype_choice is not None:
            console.print(cfg.dtype_choice.describe())
        _print_layout(cfg, list(watch.children.values()))
        if cfg.simulated:
            console.print("[yellow]simulated workers[/]: made-up tokens, modelled times "
                          "(no vLLM engine)")
        watch.start()
        watch.wait_servable(cfg.startup_timeout_s)
        console.print(f"[bold green]pdserve ready[/]: http://{cfg.host}:{cfg.port}/v1  "
                      f"(model {Path(cfg.model).name}, logs {log_dir})")
        print(f"http://{cfg.host}:{cfg.port}/v1", flush=True)
        _announce_targets(cfg, list(watch.children.values()))
        return watch.serve()
    except KeyboardInterrupt:
        console.print("stopping pdserve...")
        return 0
    except RuntimeError as exc:
        console.print(f"[red]pdserve failed to start[/]: {exc}")
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        watch.stop(STOP_GRACE_S)
