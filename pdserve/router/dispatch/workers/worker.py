"""One worker as the router sees it (``Worker``): its gRPC client, its health checks,
its circuit breaker, the role it serves now, and the immutable ``WorkerState`` snapshot
placement reads. The set of them is ``pool.WorkerPool``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.grpc_options import DEFAULT_KEEPALIVE_S
from pdserve.core.grpc_tls import GrpcTls
from pdserve.core.types import WorkerHealth, WorkerLoadReport
from pdserve.membership import WorkerInfo
from pdserve.router.dispatch.policies.tier_cost import load_rates
from pdserve.router.dispatch.workers.breaker import DEFAULT_BREAKER, BreakerConfig, CircuitBreaker
from pdserve.router.dispatch.workers.client import DEADLINE_EXCEEDED, WorkerCallError, WorkerClient
from pdserve.router.dispatch.workers.loras import LoraTargets
from pdserve.router.dispatch.workers.state import InFlight, StepCost, WorkerLoad, WorkerState

logger = logging.getLogger("pdserve.router.workers")

# A worker that answers too slowly is busy, not gone: only this many probe
# timeouts in a row take it out of placement (a refused connection does at once).
MAX_SLOW_PROBES = 3


class Worker:
    """One worker as the router sees it: its gRPC client, and the snapshot placement
    reads. The snapshot is replaced, never changed: each health check and each
    ``on_sent`` / ``on_finished`` publishes a new one, combining the worker's last
    report with this router's in-flight work on it."""

    def __init__(self, info: WorkerInfo, secret: ClusterSecret | None = None,
                 tls: GrpcTls | None = None, keepalive_s: float = DEFAULT_KEEPALIVE_S,
                 breaker: BreakerConfig = DEFAULT_BREAKER,
                 on_role_changed: Callable[[Worker, str], None] | None = None,
                 on_id_changed: Callable[[Worker], None] | None = None,
                 lora_targets: LoraTargets | None = None) -> None:
        """``on_role_changed(worker, old_role)``: the worker now reports another role
        (a role switch); its pool files it under the new one. ``on_id_changed(worker)``:
        its Health names another id than its snapshot did (a static member's first
        answer, or a static member restarted)."""
        self.info = info
        self._on_role_changed = on_role_changed
        self._on_id_changed = on_id_changed
        # Registered members must answer with the id they registered (a stale record
        # may point at a port another worker now uses). Static members, whose id is
        # their endpoint until Health tells, learn it.
        static = info.worker_id == info.grpc_endpoint
        self._expected_id = None if static else info.worker_id
        self.client = WorkerClient(info.grpc_endpoint, secret, tls=tls,
                                   keepalive_s=keepalive_s, worker_id=self._expected_id or "")
        self._inflight = InFlight()
        # The last report, as a snapshot with nothing in flight.
        self._reported = WorkerState(endpoint=info.grpc_endpoint, role=info.role,
                                     member_id=info.member_id, worker_id=info.worker_id,
                                     compatibility_hash=info.compatibility_hash,
                                     max_model_len=info.max_model_len)
        self._snapshot = self._reported
        # Where to scrape its /metrics (not placement's concern: kept off the snapshot);
        # registered, then as its Health says (static members register nothing).
        self.metrics_endpoint = info.metrics_endpoint
        self._slow_probes = 0
        # Bumped by each probe's start and by a committed weight switch: a probe's answer
        # is adopted only if nothing newer began or landed while it was out, so a probe
        # sent before a switch never files the worker back under the old weights.
        self._generation = 0
        self._breaker = CircuitBreaker(breaker)
        self._ejected = False  # the breaker was open at the last publish
        self._switching = False  # this router is switching its role: place nothing here
        # The weights version requests run under ("": any): a worker on another one is
        # out of placement until it serves it (a worker that joined mid-update).
        self.weight_target = ""
        # The adapters this router loaded and unloaded: replayed on the worker (one that
        # joined later, or restarted) in the background after a check (``_start_replay``).
        self.lora_targets = lora_targets or LoraTargets()
        self._replaying: asyncio.Task[None] | None = None
        self._lora_off = False  # it answered FAILED_PRECONDITION (no --enable-lora)

    @property
    def member_id(self) -> str:
        return self.info.member_id

    @property
    def role(self) -> str:
        """The role it serves now: registered, then as its Health says (roles are
        state: ``POST /admin/workers/{id}/role`` switches them)."""
        return self._reported.role

    @property
    def switching(self) -> bool:
        return self._switching

    def begin_switch(self) -> None:
        """A role switch starts: place nothing new here until ``end_switch``."""
        self._switching = True
        self._publish()

    def end_switch(self, role: str | None) -> None:
        """The switch ended, in ``role`` (None: it failed; the worker kept its role)."""
        self._switching = False
        if role is not None:
            self._adopt_role(role)
        self._publish()

    @property
    def stale_weights(self) -> bool:
        """Up and ready, but serving other weights than the ones requests run under."""
        r = self._reported
        return r.healthy and bool(self.weight_target) and r.weight_version != self.weight_target

    def set_weight_target(self, version: str) -> None:
        """Place requests here only while it serves ``version`` ("": whatever it serves)."""
        self.weight_target = version
        self._publish()

    def on_weights_committed(self, version: str) -> None:
        """The worker answered a commit: it serves ``version`` now, and is ready (a
        probe during the commit found it not ready: another router process, told of the
        commit through the weight board, would otherwise refuse requests as having no
        worker until its next probe). Probes already out may carry the state before it;
        their answers are dropped."""
        self._generation += 1
        self._report(weight_version=version, healthy=True)

    def _adopt_role(self, role: str) -> None:
        old = self._reported.role
        if role == old:
            return
        logger.info("worker %s at %s now serves %s (was %s)", self._reported.worker_id,
                    self._reported.endpoint, role, old)
        self._reported = replace(self._reported, role=role)
        self._publish()
        if self._on_role_changed is not None:
            self._on_role_changed(self, old)

    @property
    def ejected(self) -> bool:
        return self._ejected

    def snapshot(self) -> WorkerState:
        """The current snapshot (immutable; a later change publishes a new one). An
        ejected worker whose back-off has passed is readmitted here, on trial."""
        if self._ejected and not self._breaker.is_open():
            self._ejected = False
            logger.info("%s worker at %s readmitted after its back-off", self.info.role,
                        self.info.grpc_endpoint)
            self._publish()
        return self._snapshot

    def on_call_failed(self, code: str) -> bool:
        """A call to the worker failed with gRPC status ``code``; True if that ejected
        it from placement (its circuit breaker opened)."""
        if not self._breaker.on_failure(code):
            return False
        logger.warning("%s worker at %s ejected for %.1f s after %d failed calls in a row",
                       self.info.role, self.info.grpc_endpoint,
                       self._breaker.open_for_s, self._breaker.num_failures)
        self._ejected = True
        self._publish()
        return True

    def on_call_succeeded(self) -> None:
        self._breaker.on_success()
        if self._ejected:
            self._ejected = False
            self._publish()

    def on_sent(self, uncached_tokens: int = 0) -> None:
        """This router sent the worker a request (a prefill: with that many prompt
        tokens outside its prefix cache)."""
        self._inflight.on_sent(uncached_tokens)
        self._publish()

    def on_prefilled(self, uncached_tokens: int) -> None:
        """A request sent with ``on_sent(uncached_tokens)`` has its prompt computed (its
        first token came); it stays assigned, its tokens no longer queued."""
        self._inflight.on_prefilled(uncached_tokens)
        self._publish()

    def on_finished(self, uncached_tokens: int = 0) -> None:
        """A request sent with ``on_sent(uncached_tokens)`` ended, however it ended."""
        self._inflight.on_finished(uncached_tokens)
        self._publish()

    async def refresh(self, timeout_s: float) -> None:
        """Health, then load; a failure marks the worker unhealthy, except a probe
        that timed out, which does only ``MAX_SLOW_PROBES`` times in a row: a worker
        whose cores are busy computing may answer late, and taking it out of
        placement for that sends its requests elsewhere (or to no prefill at all).
        A probe overtaken by a newer one (or by a weight commit, or by a call that found
        the worker unreachable) adopts nothing."""
        self._generation += 1
        generation = self._generation
        try:
            health = await self.client.health(timeout_s)
            self._check_identity(health)
            load = await self.client.load(timeout_s)
        except WorkerCallError as exc:
            if generation != self._generation:
                return
            if exc.code == DEADLINE_EXCEEDED and self._reported.healthy:
                self._slow_probes += 1
                if self._slow_probes < MAX_SLOW_PROBES:
                    logger.info("%s worker at %s answered its probe late (%d in a row)",
                                self._reported.role, self._reported.endpoint,
                                self._slow_probes)
                    return
            self.mark_unhealthy(exc.details)
            return
        except (ValueError, RuntimeError) as exc:
            if generation == self._generation:
                self.mark_unhealthy(str(exc))
            return
        if generation != self._generation:
            logger.debug("%s worker at %s: a newer probe or commit overtook this probe",
                         self._reported.role, self._reported.endpoint)
            return
        self._slow_probes = 0
        self._adopt_health(health, load)
        self._start_replay(health, timeout_s)

    def _start_replay(self, health: WorkerHealth, timeout_s: float) -> None:
        """Bring it to the router's adapters in the background (one replay at a time)."""
        if self._replaying is not None and not self._replaying.done():
            return
        if self._lora_off or not self.lora_targets.needs_replay(health):
            return
        self._replaying = asyncio.create_task(self._replay(health, timeout_s))

    async def _replay(self, health: WorkerHealth, timeout_s: float) -> None:
        result = await self.lora_targets.replay(self.client, health)
        self._lora_off = result.lora_off
        if result.changed:  # what it serves now is what placement reads
            await self.refresh(timeout_s)

    async def lora_replayed(self) -> None:
        """Wait for the replay running now, if one is (tests)."""
        if self._replaying is not None:
            await asyncio.shield(self._replaying)

    def _adopt_health(self, health: WorkerHealth, load: WorkerLoadReport) -> None:
        """The worker answered: its role, id and load as it reports them."""
        self.metrics_endpoint = health.metrics_endpoint
        self._adopt_role(health.role)
        if not self._reported.healthy and health.ready:
            self._lora_off = False  # back (a restart may have turned LoRA on)
            logger.info("%s worker %s at %s is healthy", self._reported.role, health.worker_id,
                        self._reported.endpoint)
        old_id = self._reported.worker_id
        self._report(healthy=health.ready, worker_id=health.worker_id,
                     compatibility_hash=health.compatibility_hash, model=health.model,
                     max_model_len=health.max_model_len, kv_host=health.kv_host,
                     kv_port=health.kv_port, kv_push=health.kv_push,
                     prefill_chunk_tokens=health.prefill_chunk_tokens,
                     weight_version=health.weight_version, kv_store_id=health.kv_store_id,
                     kv_store_ttl_s=health.kv_store_ttl_s,
                     kv_compression=health.kv_compression, loras=health.loras,
                     load=_placement_load(load))
        if health.worker_id != old_id and self._on_id_changed is not None:
            self._on_id_changed(self)

    def _check_identity(self, health: WorkerHealth) -> None:
        endpoint = self._reported.endpoint
        if self._expected_id is not None and health.worker_id != self._expected_id:
            raise RuntimeError(f"{endpoint} is worker {health.worker_id!r}, "
                               f"not the registered {self._expected_id!r}")

    def mark_unhealthy(self, why: str) -> None:
        """Out of placement until a probe finds it ready. A probe already out adopts
        nothing: its answer predates what marked it (a request's call that found it
        gone), and would put a stopped worker back until the next probe."""
        self._generation += 1
        if self._reported.healthy:
            logger.warning("%s worker at %s unhealthy: %s", self._reported.role,
                           self._reported.endpoint, why)
        self._report(healthy=False)

    def on_removed(self) -> None:
        """The worker left the view: never place on it again (a probe out adopts nothing)."""
        self._generation += 1
        self._report(healthy=False)

    def _report(self, **changes: Any) -> None:
        self._reported = replace(self._reported, **changes)
        self._publish()

    def _publish(self) -> None:
        # Built field by field: twice per request per worker, and ``replace`` costs 2x.
        r, inflight = self._reported, self._inflight
        self._snapshot = WorkerState(
            endpoint=r.endpoint, role=r.role,
            healthy=r.healthy and not self._ejected and not self._switching
            and (not self.weight_target or r.weight_version == self.weight_target),
            member_id=r.member_id, worker_id=r.worker_id,
            compatibility_hash=r.compatibility_hash, model=r.model,
            max_model_len=r.max_model_len, kv_host=r.kv_host, kv_port=r.kv_port,
            kv_push=r.kv_push, prefill_chunk_tokens=r.prefill_chunk_tokens,
            weight_version=r.weight_version, kv_store_id=r.kv_store_id,
            kv_store_ttl_s=r.kv_store_ttl_s, kv_compression=r.kv_compression, loras=r.loras,
            load=r.load,
            num_assigned=inflight.num_assigned,
            num_assigned_tokens=inflight.num_assigned_tokens)

    async def close(self, grace_s: float | None = None) -> None:
        if self._replaying is not None:
            self._replaying.cancel()
        await self.client.close(grace_s)


def _placement_load(report: WorkerLoadReport) -> WorkerLoad:
    return WorkerLoad(report.num_running_reqs, report.num_waiting_reqs, report.kv_cache_usage,
                      report.num_inflight_reqs, step_cost(report), load_rates(report),
                      report.kv_links)


def step_cost(report: WorkerLoadReport) -> StepCost | None:
    """The engine's step fit from its report; None before it has measured any step."""
    if not (report.step_decode_samples or report.step_prefill_samples):
        return None
    return StepCost(report.step_base_us / 1e6, report.step_per_seq_us / 1e6,
                    report.step_per_token_ns / 1e9, report.step_decode_samples > 0,
                    report.step_prefill_samples > 0)
