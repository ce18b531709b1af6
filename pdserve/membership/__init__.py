"""Cluster membership: static (flags or a file) or etcd (leases + watch), and the
election of the one router that runs the planner.

``create_membership`` (router side), ``create_registrar`` (worker side) and
``create_election`` (router side) pick an implementation by name from
``MembershipConfig.kind``; an unknown name fails listing the valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from pdserve.core.cluster_secret import optional_secret
from pdserve.core.grpc_tls import TlsFiles
from pdserve.membership.base import (
    Membership,
    MembershipSink,
    Registrar,
    WorkerInfo,
    check_name,
    worker_key,
)
from pdserve.membership.election import Election, StaticElection, leader_key
from pdserve.membership.etcd import EtcdMembership
from pdserve.membership.etcd_client import EtcdAuth, check_etcd_url
from pdserve.membership.etcd_election import EtcdElection
from pdserve.membership.etcd_registrar import DEFAULT_TTL_S, EtcdRegistrar
from pdserve.membership.static import NullRegistrar, StaticMembership, load_workers_file

MEMBERSHIPS = ("static", "etcd")

__all__ = ["DEFAULT_TTL_S", "EtcdAuth", "MEMBERSHIPS", "Election", "Membership", "MembershipConfig",
           "MembershipSink", "Registrar", "StaticElection", "WorkerInfo", "check_name",
           "create_election", "create_membership", "create_registrar", "leader_key",
           "worker_key"]


@dataclass(frozen=True)
class MembershipConfig:
    kind: str = "static"
    etcd_url: str = ""
    cluster: str = "default"
    ttl_s: int = DEFAULT_TTL_S
    # static only: gRPC endpoints, or a JSON file {"prefill": [...], "decode": [...]}
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    workers_file: str = ""
    # etcd: an https:// URL is TLS with these files (the client certificate, the CA);
    # ``required`` (--require-tls) refuses an http:// one.
    tls: TlsFiles = TlsFiles()
    # etcd's user/password auth (--etcd-user, --etcd-password-file)
    auth: EtcdAuth = EtcdAuth()
    # the cluster secret's file: registrations are signed with it, and read only if they
    # verify (``signed.py``)
    secret_file: str = ""

    def __post_init__(self) -> None:
        if self.kind not in MEMBERSHIPS:
            raise ValueError(f"unknown membership {self.kind!r}; valid: {', '.join(MEMBERSHIPS)}")
        check_name("cluster", self.cluster)
        if self.kind == "etcd":
            check_etcd_url(self.etcd_url, self.tls)
        if self.ttl_s < 2:
            raise ValueError("--etcd-ttl-s must be >= 2 (etcd's minimum lease TTL)")

    @classmethod
    def from_flags(cls, etcd_url: str | None, cluster: str, ttl_s: int,
                   prefill: tuple[str, ...] = (), decode: tuple[str, ...] = (),
                   workers_file: str | None = None,
                   tls: TlsFiles | None = None, auth: EtcdAuth | None = None,
                   secret_file: str | None = None) -> MembershipConfig:
        """etcd when ``--etcd`` is given, else static."""
        tls = tls or TlsFiles()
        auth = auth or EtcdAuth()
        if auth.user and not etcd_url:
            raise ValueError("--etcd-user needs --etcd")
        if etcd_url and (prefill or decode or workers_file):
            raise ValueError("give either --etcd or static workers (--prefill/--decode/"
                             "--workers-file), not both")
        if etcd_url:
            return cls("etcd", etcd_url=etcd_url, cluster=cluster, ttl_s=ttl_s, tls=tls,
                       auth=auth, secret_file=secret_file or "")
        return cls("static", cluster=cluster, ttl_s=ttl_s, prefill=prefill, decode=decode,
                   workers_file=workers_file or "", tls=tls)


def create_membership(config: MembershipConfig,
                      registry: CollectorRegistry | None = None) -> Membership:
    if config.kind == "etcd":
        return EtcdMembership(config.etcd_url, config.cluster, registry=registry, tls=config.tls,
                              secret=optional_secret(config.secret_file), auth=config.auth)
    prefill, decode = config.prefill, config.decode
    if config.workers_file:
        file_prefill, file_decode = load_workers_file(config.workers_file)
        prefill, decode = prefill + tuple(file_prefill), decode + tuple(file_decode)
    return StaticMembership(prefill, decode)


def create_registrar(config: MembershipConfig) -> Registrar:
    if config.kind == "etcd":
        return EtcdRegistrar(config.etcd_url, config.cluster, config.ttl_s, tls=config.tls,
                             secret=optional_secret(config.secret_file), auth=config.auth)
    return NullRegistrar()


def create_election(config: MembershipConfig, candidate: bool, candidate_id: str) -> Election:
    """etcd: every candidate campaigns and one leads; static (or not a candidate): this
    process leads iff it is a candidate."""
    if config.kind == "etcd" and candidate:
        return EtcdElection(config.etcd_url, config.cluster, candidate_id, config.ttl_s,
                            tls=config.tls, auth=config.auth)
    return StaticElection(candidate, candidate_id)
