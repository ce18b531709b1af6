"""The pdserve KV connector, loaded by vLLM through ``kv_connector_module_path``.

vLLM builds one instance per process: the scheduler-side one in EngineCore and
a worker-side one per Worker rank. This class only routes each call to the side
that owns it (``SchedulerSide`` / ``WorkerSide``); importing it has no effects.

Block ownership follows vLLM's contract: a prefill request's blocks stay
allocated from ``request_finished`` (returning True) until its id comes back in
``finished_sending`` (after the pull, a release, or lease expiry); a decode
request's blocks are written only between ``update_state_after_alloc`` and its
id coming back in ``finished_recving``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.version import __version__ as vllm_version

from pdserve.core.block_hash import STORE_TIER
from pdserve.kv_transfer.block_names import hashes_name_blocks
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.metadata import PdserveConnectorMetadata
from pdserve.kv_transfer.remote.setup import store_planner, store_worker
from pdserve.kv_transfer.scheduler_side import SchedulerSide
from pdserve.kv_transfer.tiers.disk import compat_hash, scan
from pdserve.kv_transfer.tiers.fingerprint import checkpoint_fingerprint
from pdserve.kv_transfer.tiers.host import num_slots
from pdserve.kv_transfer.tiers.index import TierIndex
from pdserve.kv_transfer.tiers.plan import EVENT_MEDIUM, TierPlanner
from pdserve.kv_transfer.tiers.policies.registry import make_policy
from pdserve.kv_transfer.worker_side import WorkerSide, pool_transport_ok

logger = logging.getLogger("pdserve.kv_transfer")
_SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK,
            "pool": CacheHitSource.P2P, "store": CacheHitSource.EXTERNAL_UNSPECIFIED}
# The medium of the KV events announcing blocks published to the cluster store.
_MEDIUM = {**EVENT_MEDIUM, STORE_TIER: f"pdserve:{STORE_TIER}"}

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class PdserveKVStats(KVConnectorStats):
    """Transfer counters since the last report (worker → scheduler → stat loggers)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def compat_of(vllm_config: VllmConfig) -> dict[str, Any]:
    """What must match between peers besides the tensor layout."""
    model = vllm_config.model_config
    return {
        "model": model.served_model_name,
        "dtype": str(model.dtype).removeprefix("torch."),
        "block_size": vllm_config.cache_config.block_size,
        "tp_size": vllm_config.parallel_config.tensor_parallel_size,
    }


def disk_folder(vllm_config: VllmConfig, block_bytes: int, num_tensors: int,
                disk_dir: str | None) -> str:
    """The disk tier's folder for this engine. The tier outlives the process: the name
    covers the weights' content (``fingerprint.py``), not only the model's path and
    served name, and the vLLM that laid the blocks out."""
    model = str(vllm_config.model_config.model)
    compat = dict(compat_of(vllm_config), block_bytes=block_bytes, num_tensors=num_tensors,
                  model_path=model, vllm=vllm_version,
                  weights=checkpoint_fingerprint(model, disk_dir) if disk_dir else "")
    return compat_hash(compat)


@dataclass(frozen=True)
class TierSizes:
    """The KV tiers' sizes in blocks (0: off) and the disk tier's model folder, the
    same on both sides. Off where the prefix cache names blocks at another
    granularity than the KV cache's blocks."""

    host_slots: int = 0
    disk_slots: int = 0
    disk_compat: str = ""

    @classmethod
    def of(cls, config: ConnectorConfig, vllm_config: VllmConfig,
           kv_cache_config: KVCacheConfig) -> TierSizes:
        if not kv_cache_config.num_blocks or not (config.kv_offload_gib or config.kv_disk_gib):
            return cls()
        problem = hashes_name_blocks(vllm_config, kv_cache_config)
        if problem:
            logger.warning("KV tiers off: %s", problem)
            return cls()
        block_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors) // (
            kv_cache_config.num_blocks)
        disk_gib = config.kv_disk_gib
        if disk_gib and vllm_config.parallel_config.tensor_parallel_size > 1:
            logger.warning("disk tier off: one folder cannot hold several TP ranks' shards")
            disk_gib = 0.0
        return cls(num_slots(config.kv_offload_gib, block_bytes),
                   num_slots(disk_gib, block_bytes),
                   disk_folder(vllm_config, block_bytes, len(kv_cache_config.kv_cache_tensors),
                               config.kv_disk_dir) if disk_gib else "")

    def planner(self, config: ConnectorConfig, block_size: int) -> TierPlanner | None:
        """The scheduler side's plan over the tiers; the disk tier's index starts with
        what its folder still holds from before (oldest first)."""
        if not (self.host_slots or self.disk_slots):
            return None
        policy = config.kv_tier_policy
        disk = (TierIndex(self.disk_slots, make_policy(policy, self.disk_slots))
                if self.disk_slots else None)
        if disk is not None and config.kv_disk_dir:
            for slot, block_hash in scan(Path(config.kv_disk_dir), self.disk_compat,
                                         self.disk_slots):
                disk.adopt(slot, block_hash)
        return TierPlanner(block_size,
                           TierIndex(self.host_slots, make_policy(policy, self.host_slots))
                           if self.host_slots else None, disk)


class PdserveConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        assert vllm_config.kv_transfer_config is not None
        config = ConnectorConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config
        )
        block_size = self._block_size = vllm_config.cache_config.block_size
        tiers = TierSizes.of(config, vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            pool_off = hashes_name_blocks(vllm_config, kv_cache_config) or (
                "" if pool_transport_ok(config.transport, vllm_config.device_config.device_type)
                else "NCCL (--transport torch on a GPU) moves no host-tier block")
            if pool_off:
                logger.info("KV pool loads off: %s", pool_off)
            self._scheduler = SchedulerSide(config, block_size, tiers.planner(config, block_size),
                                            pool=not pool_off,
                                            store=store_planner(config, vllm_config,
                                                                kv_cache_config))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = WorkerSide(
                config, compat_of(vllm_config), get_tensor_model_parallel_rank(), block_size,
                kv_cache_config.num_blocks, tiers.host_slots, tiers.disk_slots,
                tiers.disk_compat, store=store_worker(config, vllm_config, kv_cache_config),
            )

    # ---- scheduler side --------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """Tier loads count as ``host`` and ``disk`` in vLLM's prompt-token sources; a
        remote prefill's as vLLM's default (external, unspecified)."""
        assert self._scheduler is not None
        if not num_external_tokens:
            return {}
        tiers = self._scheduler.tier_tokens(request.request_id)
        if sum(tiers.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {_SOURCES[tier]: n for tier, n in tiers.items()}

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (a weight update): the
        tiers forget every block, which was computed under the old weights. The worker
        side keeps its slots' bytes; nothing matches them any more."""
        if self._scheduler is None:
            return None
        dropped = self._scheduler.reset_tiers()
        logger.info("KV tiers dropped %d blocks", dropped)
        return True

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The tiers' residency, for the router: a block a tier now holds is a
        ``BlockStored``, one it dropped a ``BlockRemoved``, named by its pdserve hash in
        the tier's namespace (``core.block_hash.tier_hashes``) with ``medium``
        ``pdserve:<tier>`` (``vllm_kv_events`` passes them through untranslated)."""
        if self._scheduler is None:
            return ()
        events: list[KVCacheEvent] = []
        for tier, stored, tier_hashes in self._scheduler.take_events():
            medium = _MEDIUM[tier]
            hashes: list[bytes | int] = list(tier_hashes)  # vLLM's hashes are bytes or int
            events.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                      # the adapter is in the hashes (the salt)
                                      block_size=self._block_size, lora_id=None,
                                      medium=medium, lora_name=None) if stored
                          else BlockRemoved(block_hashes=hashes, medium=medium))
        return events

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # ---- worker side -----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdserveConnectorMetadata)
        self._worker.start_step(meta)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata,
                                                   PdserveConnectorMetadata):
            self._worker.begin_forward(connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads (pulled, or pushed layer by layer into the inbox) complete before
        # the request is scheduled: a step never waits on the network.
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdserveConnectorMetadata)
        self._worker.save_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        # Called once per step, right after the forward pass.
        if self._worker is not None:
            self._worker.steps.end()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._worker.poll()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks a finished load did not fill (the store's from its first missing or
        bad block on): vLLM recomputes the request from the first of them and keeps the
        blocks before (``kv_load_failure_policy="recompute"``)."""
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.feedback() if self._worker is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:  # the scheduler side asks too; it has none of its own
            return None
        delta = self._worker.stats_delta()
        return PdserveKVStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return PdserveKVStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
