"""Cluster weight updates, the router's side: vLLM's RL API and SGLang's
``/update_weights_from_disk``, fanned out to every worker of both roles.

An update from a checkpoint folder is two phases, so the cluster serves one version or
the other, never a mix:

1. **Stage** on every worker at once (``StageWeights``): each reads the folder into host
   memory and checks it against the served model. Serving goes on meanwhile. If any
   worker fails (a bad path, a worker gone), every worker drops what it staged and the
   call fails: the cluster stays on its old version, serving.
2. **Switch**: the router's gate closes (new requests wait, ``dispatch/weights.py``), the
   requests in flight drain or are aborted (the ``policy``), every worker commits
   (``CommitWeights``: an in-place copy, the prefix cache and KV tiers emptied), the
   router files the workers under the new version and the gate reopens on it. A worker
   that fails to commit keeps the old version and is out of placement until it serves
   the new one (so is a worker that joins later on another version).

vLLM's own transfer-engine calls (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) are passed to
every worker as they are, between the caller's ``/pause`` and ``/resume``, as with one
``vllm serve``. One update runs at a time (409 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry

from pdserve.core.weight_calls import (
    FinishWeightUpdate,
    UpdateWeightVersion,
    WeightCall,
    version_set_by,
)
from pdserve.router.cluster.errors import Conflict, Failed, Invalid, Unavailable
from pdserve.router.cluster.fanout import call_error, each_worker, first_error, quietly
from pdserve.router.dispatch.weight_board import Published, UpdateRunning
from pdserve.router.dispatch.weights import Ticket, WeightGate
from pdserve.router.dispatch.workers.client import WorkerCallError
from pdserve.router.dispatch.workers.pool import Worker, WorkerPool
from pdserve.router.metrics import PREFIX, counter

logger = logging.getLogger("pdserve.router.weights")

DEFAULT_DRAIN_TIMEOUT_S = 60.0
STAGE_TIMEOUT_S = 600.0  # reading a checkpoint: minutes for a large model
COMMIT_SLACK_S = 300.0  # the in-place copy, on top of the drain
CALL_TIMEOUT_S = 600.0  # vLLM's transfer-engine calls (a broadcast from the trainer)
OUTCOMES = ("updated", "stage_failed", "commit_failed")
FOLLOW_S = 0.02  # how often a process looks at what the others did to the gate
PLACEABLE_WAIT_S = 5.0  # after a commit, for the workers to be in placement again


@dataclass(frozen=True)
class DiskUpdate:
    """An update from a checkpoint folder (``POST /update_weights_from_disk``): the
    folder, the version it serves as (None: the folder's name), what running requests
    get (``drain``, ``abort``, ``keep``), how long they may drain, and how long a worker
    may take to read the checkpoint (past it the update fails and every worker keeps
    its version)."""

    model_path: str
    weight_version: str | None = None
    policy: Literal["drain", "abort", "keep"] = "drain"
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    stage_timeout_s: float = STAGE_TIMEOUT_S


class WeightUpdater:
    def __init__(self, pool: WorkerPool, gate: WeightGate,
                 registry: CollectorRegistry | None = None) -> None:
        self._pool = pool
        self._gate = gate
        self._lock = asyncio.Lock()
        self._follow_task: asyncio.Task[None] | None = None
        gate.on_published = self._on_published
        # The last update from a folder (version, path): what a worker that comes up on
        # other weights (a restart, a new one) is brought to before it is placed.
        self._source: tuple[str, str] | None = None
        self._catch_up_task: asyncio.Task[None] | None = None
        self._updates = counter(registry, f"{PREFIX}weight_updates", "Cluster weight updates "
                                "this router ran, by outcome (stage_failed: every worker kept "
                                "its version)", ["outcome"])
        for outcome in OUTCOMES:
            self._updates.labels(outcome)

    # ---- views ----

    def info(self) -> dict[str, Any]:
        """``GET /weight_info``: vLLM's answer, plus each worker's version."""
        workers = {s.worker_id or s.endpoint: s.weight_version
                   for s in (w.snapshot() for w in self._pool.all)}
        version = self._gate.version or _most_common(workers.values())
        return {"weight_version": version, "workers": workers}

    # ---- from a checkpoint folder ----

    async def update_from_disk(self, body: DiskUpdate) -> dict[str, Any]:
        """Stage everywhere, then switch everywhere; raises a ``ClusterError`` (the
        cluster keeps its version) when a worker cannot stage."""
        version = body.weight_version or f"{body.model_path.rstrip('/').rsplit('/', 1)[-1]}" \
                                         f"-{uuid.uuid4().hex[:8]}"
        async with self._exclusive():
            started = time.monotonic()
            self._gate.follow()
            workers = self._workers()
            await self._stage(workers, body.model_path, version, body.stage_timeout_s)
            staged_s = time.monotonic() - started
            self._source = (version, body.model_path)  # published with the version
            committed = await self._switch(workers, version, body.policy, body.drain_timeout_s)
        seconds = time.monotonic() - started
        self._updates.labels("updated").inc()
        logger.info("weights %s from %s on %d workers in %.2f s (staged in %.2f s)", version,
                    body.model_path, len(committed), seconds, staged_s)
        return {"success": True, "message": f"Succeeded to update model weights to {version}.",
                "weight_version": version, "seconds": seconds, "stage_seconds": staged_s,
                "workers": committed}

    async def _stage(self, workers: Sequence[Worker], path: str, version: str,
                     timeout_s: float) -> None:
        results = await each_worker(workers, lambda w: w.client.stage_weights(
            path, version, timeout_s))
        failed = {name: exc for name, exc in results.items() if isinstance(exc, Exception)}
        if not failed:
            return
        await each_worker(workers, lambda w: w.client.discard_weights(10.0))
        self._updates.labels("stage_failed").inc()
        name, exc = next(iter(failed.items()))
        what = exc.details if isinstance(exc, WorkerCallError) else str(exc)
        message = (f"{len(failed)} of {len(workers)} workers could not stage {path!r} "
                   f"(worker {name}: {what}); the cluster keeps its version")
        logger.warning("weight update refused: %s", message)
        if isinstance(exc, WorkerCallError) and exc.code == "INVALID_ARGUMENT":
            raise Invalid(message, param="model_path", code="invalid_checkpoint")
        raise Unavailable(message, code="weight_stage_failed")

    async def _switch(self, workers: Sequence[Worker], version: str, policy: str,
                      drain_timeout_s: float) -> dict[str, str]:
        """Close the gate (every router process's), end or drain what runs, commit
        everywhere, reopen on ``version``."""
        self._gate.close()
        committed: dict[str, str] = {}
        try:
            abort = policy != "drain" or not await self._gate.wait_idle(drain_timeout_s)
            if abort:
                await self._gate.abort_everywhere(keep=policy == "keep")
            self._gate.board.set_committing(True)
            results = await each_worker(workers, lambda w: w.client.commit_weights(
                version, abort, 0.0 if abort else drain_timeout_s,
                drain_timeout_s + COMMIT_SLACK_S))
            committed = {name: r.weight_version for name, r in results.items()
                         if not isinstance(r, Exception)}
            if not committed:
                self._updates.labels("commit_failed").inc()
                raise Failed(f"no worker could switch to {version}: "
                             f"{first_error(results)}", code="weight_commit_failed")
            _adopt_versions(workers, committed)
            for name, r in results.items():
                if isinstance(r, Exception):
                    logger.error("worker %s kept its weights (out of placement until it "
                                 "serves %s): %s", name, version, r)
            self._pool.set_weight_target(version)
            await asyncio.gather(*(w.refresh(5.0) for w in workers))
            await self._until_placeable(set(committed), version, PLACEABLE_WAIT_S)
            return {name: committed.get(name, "failed") for name in results}
        finally:
            self._gate.board.set_committing(False)
            self._gate.reopen(self._published(version, committed)
                              if self._pool.weight_target == version else None)

    async def _until_placeable(self, worker_ids: set[str], version: str,
                               timeout_s: float) -> None:
        """Until every worker that committed is in placement on ``version`` (a worker
        re-registers after a commit: the pool's new member is probed first), or
        ``timeout_s``: requests admitted at the reopening find them."""
        deadline = time.monotonic() + timeout_s
        ready: set[str] = set()
        while time.monotonic() < deadline:
            ready = {s.worker_id for s in (w.snapshot() for w in self._pool.all)
                     if s.healthy and s.weight_version == version}
            if worker_ids <= ready:
                return
            await asyncio.sleep(0.02)
        logger.warning("workers %s not in placement on %s %.1f s after the commit",
                       sorted(worker_ids - ready), version, timeout_s)

    def _published(self, version: str, workers: dict[str, str]) -> Published:
        source = self._source[1] if self._source and self._source[0] == version else ""
        return Published(version, source, workers)

    def _on_published(self, state: Published) -> None:
        """Another router process switched the workers to ``state.version``: place on
        them under it here too (the workers it names answered its commit)."""
        self._source = (state.version, state.source) if state.source else None
        _adopt_versions(self._pool.all, state.workers)
        self._pool.set_weight_target(state.version)
        logger.info("weights %s, switched by another router process", state.version)

    # ---- vLLM's API ----

    async def pause(self, mode: str, clear_cache: bool = True,
                    timeout_s: float = CALL_TIMEOUT_S) -> int:
        """vLLM's ``/pause``, for every router process: ``abort`` ends what runs (a
        request with no output yet runs again after ``/resume``), ``wait`` lets it
        finish (past ``timeout_s`` what still runs is ended, as ``abort``), ``keep``
        freezes it (ended on the workers; it goes on after ``/resume``, on the weights
        then served). ``clear_cache`` (not with ``keep``, as in vLLM) empties the
        workers' prefix caches once nothing runs. The requests ended."""
        if mode not in ("abort", "wait", "keep"):
            raise Invalid(f"mode must be abort, wait or keep, not {mode!r}",
                          param="mode")
        self._gate.pause()
        ended = 0
        if mode == "wait" and not await self._gate.wait_idle(timeout_s):
            logger.warning("pause: requests still ran after %.1f s: ended", timeout_s)
            mode = "abort"
        if mode != "wait":
            ended = await self._end_everywhere(keep=mode == "keep")
        if clear_cache and mode != "keep":
            await self._clear_caches()
        return ended

    def resume(self) -> None:
        """vLLM's ``/resume``; refused (409) while an update commits: reopening then
        would admit requests onto weights half switched."""
        if self._gate.board.committing or self._lock.locked():
            raise Conflict("a weight update is being committed: resume after it",
                           code="weight_update_running")
        self._gate.resume()

    @property
    def paused(self) -> bool:
        return self._gate.paused

    async def abort_requests(self, request_ids: Sequence[str] | None) -> int:
        """End the running requests (all, in every router process; or those ids, of this
        process) on every worker."""
        if request_ids is None:
            return await self._end_everywhere(keep=False)
        return await self._abort_on_workers(self._gate.abort(request_ids))

    async def _end_everywhere(self, keep: bool) -> int:
        return await self._abort_on_workers(await self._gate.abort_everywhere(keep))

    async def _abort_on_workers(self, tickets: Sequence[Ticket]) -> int:
        ids = [t.request_id for t in tickets]
        workers = self._workers(require=False)
        await asyncio.gather(*(quietly(w.client.abort(i, 5.0)) for w in workers for i in ids))
        return len(ids)

    async def _clear_caches(self) -> None:
        """Empty every worker's prefix cache and KV tiers, its version kept (vLLM's
        ``clear_cache``)."""
        workers = self._workers(require=False)
        versions = {w.snapshot().worker_id: w.snapshot().weight_version for w in workers}
        await asyncio.gather(*(quietly(w.client.engine_weight_call(
            UpdateWeightVersion(versions[w.snapshot().worker_id]), CALL_TIMEOUT_S))
            for w in workers if versions[w.snapshot().worker_id]))

    async def engine_call(self, call: WeightCall) -> dict[str, str]:
        """One of vLLM's transfer-engine calls on every worker; each one's version after.
        A call that sets a version (``finish_weight_update``, ``update_weight_version``)
        files the workers under it, as an update from disk does."""
        if isinstance(call, FinishWeightUpdate) and not call.weight_version:
            # New weights under no name: a version of their own all the same, so the
            # workers empty their prefix caches and salt what they cache anew.
            call = FinishWeightUpdate(f"{self._gate.version or 'default'}"
                                      f"@{uuid.uuid4().hex[:8]}")
        async with self._exclusive():
            workers = self._workers()
            self._gate.board.set_committing(True)
            try:
                results = await each_worker(workers, lambda w: w.client.engine_weight_call(
                    call, CALL_TIMEOUT_S))
            finally:
                self._gate.board.set_committing(False)
            if any(isinstance(r, Exception) for r in results.values()):
                raise call_error(call.name, results)
            versions: dict[str, str] = {k: v for k, v in results.items() if isinstance(v, str)}
            new = version_set_by(call)
            if new:
                self._source = None  # pushed weights: no folder to bring a newcomer to
                _adopt_versions(workers, versions)
                self._pool.set_weight_target(str(new))
                self._gate.publish(Published(str(new), "", versions))
                await asyncio.gather(*(w.refresh(5.0) for w in workers))
            return versions

    # ---- workers out of step ----

    def start(self, interval_s: float = 2.0) -> None:
        """Bring workers that come up on other weights to the cluster's, and follow what
        the router's other processes do to the gate (in the background)."""
        loop = asyncio.get_running_loop()
        self._catch_up_task = loop.create_task(self._catch_up_loop(interval_s))
        self._follow_task = loop.create_task(self._follow_loop())

    async def close(self) -> None:
        for task in (self._catch_up_task, self._follow_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _follow_loop(self) -> None:
        """Another process's abort ends this one's requests on the workers too; its
        version is adopted (``WeightGate.follow``)."""
        while True:
            await asyncio.sleep(FOLLOW_S)
            try:
                tickets = self._gate.follow()
                self._pool.lora_targets.follow()  # a worker joining gets the others' loads
                if tickets:
                    await self._abort_on_workers(tickets)
            except Exception:  # noqa: BLE001 - the next round tries again
                logger.exception("following the other router processes' weights failed")

    async def _catch_up_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.catch_up()
            except Exception:  # noqa: BLE001 - the next round tries again
                logger.exception("bringing workers to the cluster's weights failed")

    async def catch_up(self) -> list[str]:
        """Stage and commit the last update's folder on every ready worker serving other
        weights (out of placement meanwhile); the ids of those brought up to date."""
        stale = [w for w in self._pool.all if w.stale_weights]
        if self._source is None or self._lock.locked() or not stale:
            return []
        version, path = self._source
        with contextlib.suppress(Conflict):  # another process runs an update
            return await self._catch_up(stale, version, path)
        return []

    async def _catch_up(self, stale: Sequence[Worker], version: str, path: str) -> list[str]:
        async with self._exclusive():
            done = []
            for worker in stale:
                name = worker.snapshot().worker_id
                try:
                    await worker.client.stage_weights(path, version, STAGE_TIMEOUT_S)
                    await worker.client.commit_weights(version, False, 0.0, COMMIT_SLACK_S)
                except WorkerCallError as exc:
                    logger.warning("worker %s stays out of placement: cannot load weights "
                                   "%s: %s %s", name, version, exc.code, exc.details)
                    continue
                worker.on_weights_committed(version)  # placeable now, whatever probe is out
                await worker.refresh(5.0)
                logger.info("worker %s brought to weights %s", name, version)
                done.append(name)
            return done

    # ---- helpers ----

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """One update at a time in the whole router (every process); 409 otherwise."""
        if self._lock.locked():
            raise Conflict("a weight update is already running", code="weight_update_running")
        async with self._lock:
            try:
                with self._gate.board.update_lock():
                    yield
            except UpdateRunning as exc:
                raise Conflict(str(exc), code="weight_update_running") from exc

    def _workers(self, require: bool = True) -> list[Worker]:
        workers = [w for w in self._pool.all if w.snapshot().worker_id]
        if require and not workers:
            raise Unavailable("no worker to update", code="no_workers")
        return workers


def _adopt_versions(workers: Sequence[Worker], versions: dict[str, str]) -> None:
    """Each worker that answered a commit serves the version it named, from now on:
    what its probes sent before say no longer counts."""
    for worker in workers:
        version = versions.get(worker.snapshot().worker_id)
        if version:
            worker.on_weights_committed(version)


def _most_common(values: Iterable[str]) -> str:
    counts = Counter(v for v in values if v)
    return counts.most_common(1)[0][0] if counts else ""
