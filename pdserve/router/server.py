"""Runs the router process: tokenizer, worker pool, placement, dispatcher and
the OpenAI HTTP app under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import uvicorn
import uvloop
from fastapi import APIRouter, FastAPI
from prometheus_client import CollectorRegistry

from pdserve.core.cluster_secret import export_refusals, optional_secret
from pdserve.core.grpc_options import DEFAULT_KEEPALIVE_S
from pdserve.core.grpc_tls import TlsFiles
from pdserve.core.tokenizer import load_tokenizer
from pdserve.membership import (
    Election,
    Membership,
    MembershipConfig,
    StaticElection,
    create_election,
    create_membership,
)
from pdserve.router.cluster.planner_loop import PlannerLoop
from pdserve.router.cluster.roles import RoleSwitcher
from pdserve.router.cluster.weight_updates import WeightUpdater
from pdserve.router.dispatch.dispatcher import PDDispatcher
from pdserve.router.dispatch.migration import MigrationConfig
from pdserve.router.dispatch.policies.demand import DemandWindow
from pdserve.router.dispatch.policies.disagg import DisaggConfig
from pdserve.router.dispatch.policies.placement import DEFAULT_PLACEMENT, create_placement
from pdserve.router.dispatch.policies.planner import PlannerConfig
from pdserve.router.dispatch.prefix.index import PrefixIndex
from pdserve.router.dispatch.prefix.kv_feed import KvIndexFeeder
from pdserve.router.dispatch.prefix.routing import PrefixRouting
from pdserve.router.dispatch.weight_board import WeightBoard
from pdserve.router.dispatch.workers.metrics import register_pool_metrics
from pdserve.router.dispatch.workers.pool import WorkerPool
from pdserve.router.http.admin.actions import admin_actions
from pdserve.router.http.admin.app import create_admin_app
from pdserve.router.http.admin.loras import lora_actions
from pdserve.router.http.admin.transfer import WeightTransferPolicy
from pdserve.router.http.app import create_app
from pdserve.router.http.edge.config import NEEDS_SECRET, EdgeConfig
from pdserve.router.http.edge.drain import DrainingServer
from pdserve.router.http.edge.pipelining import PipelinedHttpToolsProtocol
from pdserve.router.http.openai.detokenize import byte_table
from pdserve.router.http.openai.tool_calls import ToolCalling, ToolConfig
from pdserve.router.http.openapi import ERROR_RESPONSES

logger = logging.getLogger("pdserve.router")


@dataclass(frozen=True)
class RouterConfig:
    model_path: str
    served_model_name: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int = 4096
    placement: str = DEFAULT_PLACEMENT
    kv_pool: bool = True  # prefills may pull a prompt's head from a peer's host tier
    # The index follows decode workers' KV events too (the decode-side prefix cache).
    decode_cache: bool = True
    health_interval_s: float = 2.0
    request_timeout_s: float = 600.0  # the longest a request may take; see Deadline
    grpc_keepalive_s: float = DEFAULT_KEEPALIVE_S  # see pdserve.core.grpc_options
    disagg: DisaggConfig = DisaggConfig()  # remote/local per request (dispatch/policies/disagg.py)
    log_timeline: bool = False
    metrics: bool = True  # False (--disable-metrics): no metric work, /metrics answers 404
    migration: MigrationConfig = MigrationConfig()  # decode failover (dispatch/migration.py)
    edge: EdgeConfig = EdgeConfig()  # keys, admin listener, admission, body limit, drain
    # etcd, or static (then ``prefill``/``decode`` or its workers file name the workers)
    membership: MembershipConfig = MembershipConfig()
    # The cluster secret's file: calls to workers carry its token. None: unauthenticated.
    cluster_secret_file: str | None = None
    tls: TlsFiles = TlsFiles()  # gRPC to workers over TLS when set
    planner: PlannerConfig = PlannerConfig()  # roles by load (dispatch/policies/planner.py)
    reuse_port: bool = False  # bind with SO_REUSEPORT (one of --processes on one port)
    # The weights state the processes of ``--processes N`` share (``dispatch/weight_board``),
    # set by their parent; None: this process's own memory.
    weight_board: str | None = None
    tools: ToolConfig = ToolConfig()  # tool calling with vLLM's parser (http/openai/tool_calls.py)

    def __post_init__(self) -> None:
        static = self.membership.kind == "static"
        if static and not self.decode and not self.membership.workers_file:
            raise ValueError("the router needs at least one decode worker (--decode HOST:PORT, "
                             "--workers-file, or --etcd URL)")
        create_placement(self.placement)  # validates the name
        optional_secret(self.cluster_secret_file)  # a bad secret file fails here, in one line
        if self.edge.tenant_isolation == "key" and not self.cluster_secret_file:
            raise ValueError(NEEDS_SECRET)
        self.tls.load()  # and an unreadable TLS file


def model_eos_token_ids(model_path: str, tokenizer: Any) -> frozenset[int]:
    """The ids vLLM ends a sequence on: the generation config's ``eos_token_id`` (one or
    a list) and the tokenizer's."""
    ids = {tokenizer.eos_token_id} if isinstance(tokenizer.eos_token_id, int) else set()
    path = Path(model_path) / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(t for t in (eos if isinstance(eos, list) else [eos]) if isinstance(t, int))
    return frozenset(ids)


@dataclass
class Router:
    """The router's parts, wired; ``start``/``close`` run its background work (health
    checks, membership, KV event feeds). ``serve_router`` puts ``app`` under uvicorn."""

    app: FastAPI
    pool: WorkerPool
    feeder: KvIndexFeeder
    membership: Membership
    views: APIRouter  # /workers and /prefix_index, also for the admin listener
    registry: CollectorRegistry | None  # None with metrics off
    switcher: RoleSwitcher  # runtime role switches (admin action, planner)
    planner: PlannerLoop
    election: Election  # whether this replica's planner decides
    weights: WeightUpdater  # cluster weight updates (admin actions)
    loras: APIRouter  # vLLM's LoRA load/unload routes (admin actions)

    async def start(self) -> None:
        await self.pool.start(self.membership)
        await self.feeder.start()
        await self.election.start()
        self.planner.start()
        self.weights.start()

    async def close(self) -> None:
        await self.weights.close()
        await self.planner.close()
        await self.election.close()  # resigns at once: another replica takes over
        await self.feeder.close()
        await self.pool.close()


def build_router(config: RouterConfig, tokenizer: Any) -> Router:
    """Every part of the router, from its config and its model's tokenizer."""
    registry = CollectorRegistry() if config.metrics else None
    membership = create_membership(replace(config.membership, prefill=config.prefill,
                                           decode=config.decode), registry)
    pool = WorkerPool(interval_s=config.health_interval_s,
                      secret=optional_secret(config.cluster_secret_file), tls=config.tls.load(),
                      keepalive_s=config.grpc_keepalive_s, close_grace_s=config.request_timeout_s)
    if registry is not None:
        register_pool_metrics(pool, registry)
        export_refusals(registry)  # cluster auth: refused workers and etcd entries
    index = PrefixIndex()
    feeder = KvIndexFeeder((lambda: [*pool.prefill, *pool.decode]) if config.decode_cache
                           else (lambda: pool.prefill), index, registry)
    pool.on_worker_added(lambda _: feeder.sync())
    pool.on_worker_removed(lambda _: feeder.sync())  # its index entries go at once
    demand = DemandWindow(config.planner.window_s)
    board = WeightBoard.open(Path(config.weight_board)) if config.weight_board else None
    if board is not None:  # the other router processes' LoRA loads are this one's too
        pool.lora_targets.share(board)
    placement = create_placement(config.placement, link_aware=config.disagg.link_aware)
    dispatcher = PDDispatcher(pool, placement, registry,
                              config.request_timeout_s, PrefixRouting(index, registry,
                                                                        pool=config.kv_pool),
                              config.disagg, config.migration, demand, board)
    switcher = RoleSwitcher(pool, registry)
    election = create_election(config.membership, config.planner.enabled,
                               f"{socket.gethostname()}:{config.port}:{os.getpid()}")
    planner = PlannerLoop(config.planner, pool, switcher, demand, config.disagg.slo, registry,
                          election=election)
    app = create_app(served_model_name=config.served_model_name,
                     max_model_len=config.max_model_len, tokenizer=tokenizer,
                     dispatcher=dispatcher, registry=registry, edge=config.edge,
                     secret=optional_secret(config.cluster_secret_file),
                     request_timeout_s=config.request_timeout_s, metrics_enabled=config.metrics,
                     tool_calling=ToolCalling.load(config.tools, tokenizer),
                     eos_token_ids=model_eos_token_ids(config.model_path, tokenizer),
                     loras=dispatcher.loras)
    views = _cluster_views(pool, membership, index, feeder, election)
    if not config.edge.api_keys:  # with keys, the views are the admin plane's only
        app.include_router(views)
    return Router(app, pool, feeder, membership, views, registry, switcher, planner, election,
                  WeightUpdater(pool, dispatcher.weights, registry),
                  lora_actions(dispatcher.loras, config.served_model_name))


async def serve_router(config: RouterConfig) -> None:
    tokenizer = load_tokenizer(config.model_path)
    byte_table(tokenizer, True)  # built once, before the first request waits for it
    if config.log_timeline:  # its DEBUG lines pass the root's handlers, whatever its level
        logging.getLogger("pdserve.timeline").setLevel(logging.DEBUG)
    router = build_router(config, tokenizer)
    app = router.app
    admin: list[uvicorn.Server] = []
    edge = config.edge
    if edge.admin_port:
        admin.append(_QuietServer(uvicorn.Config(
            admin_app(router, edge), host=edge.admin_bind_host, port=edge.admin_port,
            log_level="warning", lifespan="off", http=PipelinedHttpToolsProtocol)))
        note = admin_bind_note(edge)
        if note:
            logger.warning("%s", note)
    server = DrainingServer(
        uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                       timeout_graceful_shutdown=5, http=PipelinedHttpToolsProtocol),
        app.state.admission, config.edge.drain_timeout_s, companions=admin)
    await router.start()
    logger.info("router on http://%s:%d/v1: %s membership, placement %s, disagg %s, "
                "planner %s, %s, at most %d running + %d queued requests%s%s",
                config.host, config.port, router.membership.name, config.placement,
                config.disagg.mode, config.planner.mode,
                config.edge.keys_summary(), config.edge.max_concurrent, config.edge.max_queued,
                f", admin on http://{config.edge.admin_bind_host}:{config.edge.admin_port} "
                f"({'admin key' if config.edge.admin_keys else 'no admin key: loopback only'})"
                if admin else "", "" if config.metrics else ", metrics off")
    sockets = [_reuse_port_socket(config.host, config.port)] if config.reuse_port else None
    try:
        await asyncio.gather(server.serve(sockets), *(a.serve() for a in admin))
    finally:
        await router.close()


def admin_bind_note(edge: EdgeConfig) -> str:
    """What the start-up log says when the admin listener is not where --admin-host asks
    ("": it is)."""
    if edge.admin_bind_host == edge.admin_host:
        return ""
    return (f"no admin key (--admin-key-file): the admin listener binds "
            f"{edge.admin_bind_host} only, not --admin-host {edge.admin_host}")


def admin_app(router: Router, edge: EdgeConfig) -> FastAPI:
    """The admin plane's app: the full views, the actions, behind the admin key."""
    actions = admin_actions(router.switcher, router.weights, WeightTransferPolicy(
        edge.weight_transfer_backend, edge.weight_transfer_allow))
    return create_admin_app(router.registry, router.views, actions, router.loras,
                            keys=edge.admin_keys,
                            bind_host=edge.admin_bind_host, max_body_bytes=edge.max_body_bytes)


def _cluster_views(pool: WorkerPool, membership: Membership, index: PrefixIndex,
                   feeder: KvIndexFeeder, election: Election | None = None) -> APIRouter:
    """``/workers`` (with whether this replica's planner leads) and ``/prefix_index``: on
    the admin listener, and on the main port only without API keys (an open router)."""
    election = election or StaticElection(False)
    router = APIRouter()
    router.add_api_route("/workers", lambda: {"workers": pool.describe(),
                                              "membership": membership.describe(),
                                              "planner": election.describe()},
                         methods=["GET"], responses=ERROR_RESPONSES)
    router.add_api_route("/prefix_index", lambda: {
        "blocks": {w: len(index.blocks_of(w)) for w in index.workers()},
        "resyncs": {f.worker_id or f.client.endpoint: f.num_resyncs
                    for f in feeder.followers}}, methods=["GET"], responses=ERROR_RESPONSES)
    return router


class _QuietServer(uvicorn.Server):
    """The admin listener: signals are the main server's (it stops this one)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _reuse_port_socket(host: str, port: int) -> socket.socket:
    """The listening socket of one of several routers on ``host:port``: the kernel gives
    each new connection to one of them (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def run_router(config: RouterConfig) -> None:
    """On uvloop (the loop ``uvicorn.run`` would pick): it runs the router's per-token
    callbacks (gRPC reads, socket writes) for a fraction of asyncio's own loop's CPU."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve_router(config))
