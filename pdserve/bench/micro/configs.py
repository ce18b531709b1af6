"""Each micro-benchmark's frozen config (``pdserve bench <name>``'s flags become one):
here, apart from the benches, so that building them imports neither torch nor vLLM."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kv_transfer.tiers.policies.registry import check_admission, check_policy

# transfer: tokens per transfer, and the KV block size of the default model's layout.
TRANSFER_TOKENS = (1024, 4096, 16384)
TRANSFER_BLOCK_SIZE = 128
FAULTS = ("kill-prefill", "kill-decode", "stop-decode", "kill-etcd", "restart-router")
# router-cost: (a)-(c), the latency and per-chunk cost; stream, the paced streaming cost.
ROUTER_COST_PARTS = ("latency", "stream", "replicas")
# router-cost --auth: the cluster's authentication in the latency part's runs
ROUTER_COST_AUTH = ("none", "secret")


@dataclass(frozen=True)
class PlacementDecisionConfig:
    workers: int = 64
    blocks: int = 100_000
    decisions: int = 20_000
    seed: int = 0


@dataclass(frozen=True)
class RouterCostConfig:
    requests: int = 300  # (a): short requests each way
    long_requests: int = 20  # (b): long requests each way
    long_tokens: int = 256
    clients: int = 16  # (c): concurrent clients
    duration_s: float = 10.0
    loop_tokens: int = 16  # (c): max_tokens per request
    json: str | None = None  # also write the numbers to this file
    profile: str | None = None  # py-spy the router during (c) into this file
    parts: tuple[str, ...] = ("latency",)
    streams: int = 48  # stream: concurrent streams of the paced passes
    stream_tokens: int = 200  # stream: tokens per stream of the long pass
    short_rounds: int = 4  # stream: rounds of 2-token streams (per-request cost)
    lone_requests: int = 30  # stream: lone requests each way (added TTFT)
    probe_streams: int = 8  # stream: direct streams beside the routed ones (engines' ITL)
    ms_per_token: float = 20.0  # stream: the decode engines' pacing
    processes_list: tuple[int, ...] = (1, 2, 4)  # stream: router processes, one sweep each
    sweep_streams: tuple[int, ...] = (16, 32, 64, 96, 128, 192, 256, 384)
    sweep_tokens: int = 100  # stream: tokens per request in the sweep
    sweep_window_s: float = 4.0  # stream: steady-state seconds measured per sweep step
    skip_vllm_router: bool = False  # stream: no vllm-router baseline
    # stream: the sim decode steps its running requests together, as a real engine's
    # batch does (one Session message per step); False: each stream on its own timer
    lockstep: bool = True
    replica_requests: int = 300  # replicas: requests of each of the two clients
    # latency: one run per entry, in order (repeat them to interleave): "none", or
    # "secret" (a cluster secret on every process: signed calls, worker proofs)
    auth: tuple[str, ...] = ("none",)

    def __post_init__(self) -> None:
        if not self.auth or set(self.auth) - set(ROUTER_COST_AUTH):
            raise ValueError(f"--auth takes {', '.join(ROUTER_COST_AUTH)}")
        if self.replica_requests < 1:
            raise ValueError("--replica-requests must be >= 1")
        unknown = [p for p in self.parts if p not in ROUTER_COST_PARTS]
        if unknown or not self.parts:
            raise ValueError(f"unknown part(s) {', '.join(unknown) or '(none given)'}; "
                             f"valid: {', '.join(ROUTER_COST_PARTS)}")
        if self.stream_tokens <= 2 or self.sweep_tokens < 2:
            raise ValueError("--stream-tokens must be > 2 and --sweep-tokens >= 2")
        if min(self.streams, self.short_rounds, self.lone_requests, self.probe_streams,
               *self.processes_list,
               *self.sweep_streams) < 1 or self.ms_per_token <= 0:
            raise ValueError("stream counts, rounds, processes and --ms-per-token must be "
                             "positive")
        if list(self.sweep_streams) != sorted(self.sweep_streams):
            raise ValueError("--sweep-streams must rise")


@dataclass(frozen=True)
class MetricsOverheadConfig:
    rounds: int = 7
    requests: int = 60  # short requests per round
    long_requests: int = 8  # long requests per round
    long_tokens: int = 256
    observe_chunks: int = 200_000
    control: bool = False  # A/A run: both routers with metrics on
    json: str | None = None  # also write the numbers to this file


@dataclass(frozen=True)
class TtftConfig:
    reps: int = 5
    prompt_tokens: int = 500
    max_tokens: int = 64
    dtype: str = "auto"
    port_base: int = 8011  # router port; workers use the next four ports

    def __post_init__(self) -> None:
        if self.reps < 1:
            raise ValueError("--reps must be >= 1")


@dataclass(frozen=True)
class TransferPdConfig:
    tokens: int = 1024
    reps: int = 5
    max_tokens: int = 8
    dtype: str = "auto"
    port_base: int = 19300
    tls: bool = False  # also push over mutual TLS (gRPC and KV)


@dataclass(frozen=True)
class TransferConfig:
    transports: str = "tcp,ucx,torch"  # comma-separated, as given
    dtypes: str = "float32,bfloat16"
    tokens: str = ",".join(map(str, TRANSFER_TOKENS))
    reps: int = 5
    checksum: bool = False  # checksum every transfer
    device: str = "cpu"  # where both sides keep the KV: cpu, or cuda (cuda:0)
    pd: bool = False  # also the P/D part: share of TTFT, pull vs push (real vLLM)
    pd_tokens: int = 1024
    # Comma-separated Gbit/s: the serving and pulling sides on two hosts (network
    # namespaces, ``pdserve.bench.hosts``) whose links run at each rate in turn; "" : one
    # host, loopback.
    link_gbit: str = ""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, not {self.device!r}")
        if any(r <= 0 for r in self.link_rates):
            raise ValueError("link rates must be positive Gbit/s")
        if any(t % TRANSFER_BLOCK_SIZE for t in self.token_counts):
            raise ValueError("token counts must be multiples of the block size "
                             f"{TRANSFER_BLOCK_SIZE}")

    @property
    def token_counts(self) -> list[int]:
        return [int(t) for t in self.tokens.split(",")]

    @property
    def transport_names(self) -> list[str]:
        return [n for n in self.transports.split(",") if n]

    @property
    def link_rates(self) -> list[float]:
        return [float(r) for r in self.link_gbit.split(",") if r]


@dataclass(frozen=True)
class PlacementConfig:
    dtype: str = "float32"
    max_model_len: int = 1536
    num_kv_blocks: int = 26  # KV blocks (128 tokens) per prefill worker
    systems: int = 6
    users: int = 2
    turns: int = 3
    system_words: int = 620
    control_systems: int = 2
    concurrency: int = 4
    max_tokens: int = 4  # reply length per turn (1: prefill answers alone, no decode)


@dataclass(frozen=True)
class FaultsConfig:
    simulated: bool = False  # sim-worker processes, no vLLM
    faults: tuple[str, ...] = FAULTS
    num_prefill: int = 1
    num_decode: int = 2
    clients: int = 3  # concurrent clients
    max_tokens: int = 16
    pre_s: float = 3.0  # load before the fault
    fault_s: float = 10.0  # load after the fault
    stop_s: float = 8.0  # stop-decode: SIGCONT after
    post_s: float = 3.0  # load after recovery
    recover_s: float = 180.0  # wait at most this long for every worker to be healthy again
    deadline_s: float = 60.0  # a request unanswered after this long counts as hung
    settle_s: float = 40.0  # wait at most this long for the workers to hold nothing
    startup_timeout_s: float = 600.0
    json: str | None = None  # write results here (default: in the log folder)

    def __post_init__(self) -> None:
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ValueError(f"unknown fault(s) {', '.join(unknown)}; "
                             f"valid: {', '.join(FAULTS)}")


@dataclass(frozen=True)
class OverloadConfig:
    rates: tuple[float, ...] = (10.0, 40.0, 160.0)  # offered request rates (req/s), one run each
    duration_s: float = 15.0
    max_concurrent: int = 8
    max_queued: int = 16
    max_queue_wait_s: float = 5.0
    max_tokens: int = 64  # per request (sim: 2 ms each)
    deadline_s: float = 60.0
    max_connections: int = 4096
    seed: int = 0
    json: str | None = None  # write results here (default: in the log folder)


@dataclass(frozen=True)
class FuzzConfig:
    inputs: int = 2000  # per port
    seed: int = 0
    concurrency: int = 16  # connections at a time (slow and stalled ones run beside them)
    # A worker's KV port (HOST:PORT) instead of the in-process transports.
    target: str | None = None
    cluster_secret_file: str | None = None  # --target's cluster secret
    idle_timeout_s: float = 2.0  # in process: the servers' idle deadline (stalls hit it)
    # --target: how long it may hold a stalled connection (its idle timeout; its
    # default is 300 s); unset: no stalled inputs against it.
    stall_deadline_s: float | None = None
    json: str | None = None  # also write the reports to this file

    def __post_init__(self) -> None:
        if self.inputs < 1 or self.concurrency < 1:
            raise ValueError("--inputs and --concurrency must be >= 1")
        if self.idle_timeout_s <= 0 or (self.stall_deadline_s or 1) <= 0:
            raise ValueError("--idle-timeout-s and --stall-deadline-s must be > 0")
        if self.target is not None:
            host, _, port = self.target.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--target must be HOST:PORT, got {self.target!r}")
        elif self.cluster_secret_file or self.stall_deadline_s:
            raise ValueError("--cluster-secret-file and --stall-deadline-s go with --target")

    @property
    def address(self) -> tuple[str, int]:
        """--target's host and port."""
        host, _, port = (self.target or "").rpartition(":")
        return host.strip("[]"), int(port)


ROLLOUT_POLICIES = ("drain", "abort")


@dataclass(frozen=True)
class RolloutConfig:
    """``pdserve bench rollout``: generate a batch, refit, repeat (an RL loop's serving
    side). Without ``url`` the bench starts ``pdserve up`` on the default model itself."""

    url: str | None = None  # the router, e.g. http://127.0.0.1:8000 (default: start one)
    admin_url: str | None = None  # its admin listener (needed with url)
    api_key: str | None = None
    admin_key: str | None = None
    model_path: str | None = None  # the checkpoint the cluster serves (default: the default)
    checkpoint_dir: str | None = None  # where the perturbed copy goes (default: the cache)
    rounds: int = 3
    batch: int = 8  # prompts per round
    n: int = 4  # samples per prompt
    max_tokens: int = 64
    temperature: float = 1.0
    load: int = 2  # background streams during each refit (0: no timeline)
    load_max_tokens: int = 64
    window_s: float = 0.5
    before_s: float = 2.0  # load before each refit call, and after its first new token
    policy: str = "drain"
    drain_timeout_s: float | None = None
    scale: float = 0.05  # the perturbed checkpoint's noise (pdserve.bench.models.checkpoints)
    deadline_s: float = 300.0  # one request, or the refit call, unanswered this long: fails
    startup_timeout_s: float = 900.0
    dtype: str = "auto"
    seed: int = 0
    json: str | None = None

    def __post_init__(self) -> None:
        if self.policy not in ROLLOUT_POLICIES:
            raise ValueError(f"--policy {self.policy!r}: choose one of "
                             f"{', '.join(ROLLOUT_POLICIES)}")
        if (self.url is None) != (self.admin_url is None):
            raise ValueError("--url and --admin-url go together (an existing cluster); "
                             "give both, or neither to let the bench start one")
        if min(self.rounds, self.batch, self.n, self.max_tokens, self.load_max_tokens) < 1:
            raise ValueError("--rounds, --batch, --n, --max-tokens and --load-max-tokens "
                             "must be >= 1")
        if self.load < 0:
            raise ValueError("--load must be >= 0")
        if not (self.window_s > 0 and self.before_s >= self.window_s and self.deadline_s > 0):
            raise ValueError("--window-s and --deadline-s must be > 0 and --before-s >= "
                             "--window-s")
        if self.n > 1 and self.temperature <= 0:
            raise ValueError("--n > 1 needs --temperature > 0 (greedy samples are equal)")


# cache-sim: the policies the simulator alone has (they need the future, or no bound).
CACHE_SIM_ONLY = ("belady", "infinite")


@dataclass(frozen=True)
class CacheSimConfig:
    trace: str = ""  # a Mooncake-format JSONL trace
    capacity_blocks: tuple[int, ...] = (1000, 3000, 10000)
    policy: tuple[str, ...] = ("lru", "default", "wtinylfu", "belady", "infinite")
    json: str | None = None  # also write the JSON lines to this file
    # the store's admission (a --kv-store-admission name) in front of every policy
    admission: str = "all"

    def __post_init__(self) -> None:
        if not self.trace:
            raise ValueError("--trace FILE is required")
        if not self.capacity_blocks or min(self.capacity_blocks) < 1:
            raise ValueError("--capacity-blocks must be blocks >= 1")
        for spec in self.policy:
            if spec not in CACHE_SIM_ONLY:
                check_policy(spec)
        check_admission(self.admission)


@dataclass(frozen=True)
class KvStoreConfig:
    url: str = ""  # a store URL; "" starts a local redis-server for the run
    value_mib: tuple[float, ...] = (0.09, 1.0, 4.0)
    total_mib: int = 128  # bytes written (and read) per value size and repetition
    batch_mib: int = 16  # bytes per put_blocks / get_blocks call (one round trip)
    reps: int = 3
    json: str | None = None  # also write the JSON lines to this file
    tls: bool = False  # the local server over TLS (mutual, a throwaway CA): what TLS costs

    def __post_init__(self) -> None:
        if not self.value_mib or min(self.value_mib) <= 0:
            raise ValueError("--value-mib must be sizes > 0")
        if self.tls and self.url:
            raise ValueError("--tls is for the local server: give a rediss:// --url instead")
        if max(self.value_mib) > min(self.total_mib, 512):
            raise ValueError("--value-mib must be <= --total-mib (and 512)")
        if self.batch_mib < 1 or self.reps < 1:
            raise ValueError("--batch-mib and --reps must be >= 1")


@dataclass(frozen=True)
class KvCompressionConfig:
    dtypes: tuple[str, ...] = ("float32", "bfloat16")  # the engine's dtype, one capture each
    modes: tuple[str, ...] = ("none", "lossless", "int8", "fp8")
    prompts: int = 4  # prompts (repository docs, real text: 2,000 tokens each)
    blocks: int = 24  # full blocks captured per dtype (the default model: 128 tokens each)
    reps: int = 5
    random: bool = True  # also random normal blocks of the same shape: the contrast
    json: str | None = None  # default: bench/results/kv-compression-<time>.json

    def __post_init__(self) -> None:
        if not self.dtypes or not set(self.dtypes) <= {"float32", "bfloat16", "float16"}:
            raise ValueError("--dtypes: one or more of float32, bfloat16, float16")
        if not self.modes or not set(self.modes) <= {"none", "lossless", "int8", "fp8"}:
            raise ValueError("--modes: one or more of none, lossless, int8, fp8")
        if self.prompts < 1 or self.blocks < 1 or self.reps < 1:
            raise ValueError("--prompts, --blocks and --reps must be >= 1")
