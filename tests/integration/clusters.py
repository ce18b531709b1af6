"""The ``pdserve up`` clusters that integration tests share through ``pd_server``, by
name, and the slot that runs them: one at a time, kept while consecutive tests ask for
the same one.

A cluster costs two or three vLLM engine starts (25-35 s each on two cores), so every
test that can run on one of these configurations asks for it (parametrizing
``pd_server`` indirectly; ``TCP`` when it does not). pytest runs tests in file order:
the tests of one cluster stay together because their files sort together (each
constant says which files). Once the next test wants another cluster, or none, the
running one is killed, so no idle cluster holds memory, or restarts a worker a test
killed, beside the next test."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from integration.pd_cases import LOCAL_PREFILL_MAX_TOKENS
from pdserve_testing import Server, kill_cluster

from pdserve.core.grpc_tls import TlsFiles

STARTUP_TIMEOUT_S = 600  # a cluster's (or vllm serve's) engines loading, on a loaded machine


@dataclass(frozen=True)
class PdCluster:
    """A ``pdserve up`` of one prefill worker (or ``num_prefill``) and one decode
    worker, float32 unless ``dtype`` says (``auto``: this machine's native dtype), KV
    checksummed, its sends paced by ``throttle_mib_s`` (0: not paced)."""

    name: str
    transport: str = "tcp"
    throttle_mib_s: int = 0
    disagg: str = "always"
    dtype: str = "float32"
    num_prefill: int = 1
    kv_push: bool | None = True  # None: the workers' default (push on CUDA only)
    kv_offload_gib: float = 0.0  # each worker's host tier (0: none)
    kv_pool: bool = True  # the router may plan prefills' pulls from peers' host tiers
    decode_cache: bool = True  # the router follows decode's KV events (--decode-cache)
    # --require-tls: mutual TLS on gRPC, KV and etcd, certificates from a test CA
    # (the fixture's); and membership on up's own etcd (--with-etcd).
    require_tls: bool = False
    with_etcd: bool = False

    def argv(self, port: int, tls: TlsFiles | None = None) -> list[str]:
        argv = ["--dtype", self.dtype, "--port", str(port), "--kv-cache-gib", "1",
                "--max-model-len", "4096", "--transport", self.transport, "--kv-checksum",
                "--kv-throttle-mib-s", str(self.throttle_mib_s), "--disagg", self.disagg,
                "--local-prefill-max-tokens", str(LOCAL_PREFILL_MAX_TOKENS),
                "--num-prefill", str(self.num_prefill),
                "--kv-pool", "on" if self.kv_pool else "off",
                "--decode-cache", "on" if self.decode_cache else "off",
                "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
        if self.kv_push is not None:
            argv.append("--kv-push" if self.kv_push else "--no-kv-push")
        if self.kv_offload_gib:
            argv += ["--kv-offload-gib", str(self.kv_offload_gib)]
        if self.require_tls:
            if tls is None:
                raise ValueError(f"cluster {self.name} requires TLS: give it the files")
            argv += [*tls.flags(), "--require-tls"]
        if self.with_etcd:
            argv.append("--with-etcd")
        return argv


# KV pushed; --disagg auto: CASES' short prompts run on decode alone, the long ones go
# P -> D. test_openai_seeds.py, test_openai_surface.py, test_openai_tenants.py (a second
# router of its own), then test_pd_e2e*.py up to the transports', the last of them
# test_pd_e2e_tls_admin_plane.py (a keyed router of its own; its fuzz may pause, abort
# and refit the workers).
# The decode-side cache is off: the tests send the same long prompt through the remote
# path test after test, and the decode worker, holding it from the first, would take
# every later one local (``decode_cached``, computed as a short prompt is). The cache has
# tests of its own (TWO_PREFILL, ``test_placement_e2e_decode_cache.py``).
TCP = PdCluster("tcp", disagg="auto", decode_cache=False, require_tls=True, with_etcd=True)
# The other transports run --disagg always (their transport on every case), in
# test_pd_e2e_transports.py: ucx in this machine's native dtype (bf16 where the CPU has
# it), torch paced to 48 MiB/s so that a test can kill a transfer in its middle.
UCX_NATIVE_DTYPE = PdCluster("ucx-native-dtype", transport="ucx", dtype="auto")
TORCH_THROTTLED = PdCluster("torch-48mib", transport="torch", throttle_mib_s=48)
# Two prefill workers and a decode, each with a host tier (the cluster KV pool pulls
# from it), sends paced to 8 MiB/s (a 3-block pool pull takes ~2 s: long enough to
# kill its server mid-pull), KV pulled, not pushed (a push would be paced too). The
# router plans no pool pulls: the placement tests count what each prefill computes.
# test_placement_e2e.py, then test_placement_kv_pool.py, whose last test kills a worker.
TWO_PREFILL = PdCluster("two-prefill", throttle_mib_s=8, num_prefill=2, kv_push=None,
                        kv_offload_gib=0.1, kv_pool=False)


def cluster_id(cluster: PdCluster) -> str:
    """A parametrized test's id part (``ids=cluster_id``)."""
    return cluster.name


def wanted(item: pytest.Item | None) -> PdCluster | None:
    """The cluster ``item`` asks for (None: it uses none, or there is no item)."""
    if item is None or "pd_server" not in getattr(item, "fixturenames", ()):
        return None
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("pd_server", TCP) if callspec is not None else TCP


class ClusterSlot:
    """At most one cluster up at a time: ``get`` returns the one asked for, killing
    another one first; ``stop`` kills the running one."""

    def __init__(self) -> None:
        self.cluster: PdCluster | None = None
        self._server: Server | None = None

    def get(self, cluster: PdCluster, start: Callable[[PdCluster], Server]) -> Server:
        if cluster != self.cluster or self._server is None:
            self.stop()
            self._server = start(cluster)
            self.cluster = cluster
        return self._server

    def stop(self) -> None:
        server, self._server, self.cluster = self._server, None, None
        if server is not None:
            kill_cluster(server.proc)
