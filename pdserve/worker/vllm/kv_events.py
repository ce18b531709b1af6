"""vLLM's KV cache events -> the worker's ``KvCacheMirror``.

Every worker's engine (whatever its role) publishes ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` batches on a ZMQ PUB socket (EngineCore process) with
sequence numbers and a replay ROUTER socket. ``ZmqKvEventSource`` subscribes from
the worker's own process on a thread, replays missed batches on a seq gap, and
hands translated changes to the event loop. ``VllmEventTranslator`` turns vLLM's
block hashes into pdserve chained hashes, computed from the token ids the events
carry (vLLM's removal events name blocks by vLLM hash only, hence the map). The
connector's own events (``medium`` ``pdserve:host``/``pdserve:disk``: which blocks
its KV tiers hold) already name blocks by pdserve hash in the tier's namespace and
pass through as they are: one stream, one seq, one snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.core.block_hash import chain_hashes, salt_root
from pdserve.worker.kv.mirror import KvCacheMirror

logger = logging.getLogger("pdserve.worker.kv_events")
_END_SEQ = -1
_REPLAY_TIMEOUT_MS = 2000

Change = tuple[bool, list[int], list[int]]  # (cleared, stored, removed)


@dataclass(frozen=True)
class KvEventEndpoints:
    """ZMQ endpoints of one engine's publisher (ipc: sockets in the engine's folder)."""

    pub: str
    replay: str

    @classmethod
    def for_worker(cls, name: str, directory: Path) -> KvEventEndpoints:
        """The endpoints named ``name`` in ``directory`` (the engine's own folder,
        ``engine_tmp.engine_folder``); first removes the socket files there that engines
        killed before their worker could remove them left behind (where the operator's
        ``VLLM_RPC_BASE_PATH`` is a folder that outlives its workers)."""
        remove_stale_sockets(directory)
        base = directory / f"pdserve-kvev-{name}"
        return cls(pub=f"ipc://{base}.pub", replay=f"ipc://{base}.replay")

    def remove_files(self) -> None:
        """Delete the ipc socket files (after the engine, which bound them, is gone)."""
        for endpoint in (self.pub, self.replay):
            if endpoint.startswith("ipc://"):
                Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


def remove_stale_sockets(directory: Path) -> None:
    """Deletes the KV event socket files in ``directory`` that nothing listens on any
    more (a live engine's refuse no connection; another user's are left alone)."""
    for path in directory.glob("pdserve-kvev-*"):
        if path.suffix in (".pub", ".replay") and not _listened_on(path):
            with contextlib.suppress(PermissionError):  # another user's, in a sticky /tmp
                path.unlink(missing_ok=True)


def _listened_on(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket ``path`` (a refused
    connection: its owner is gone; any other error: not ours to judge, kept)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            return False
        except OSError:
            return True
    return True


class VllmEventTranslator:
    """Keeps vLLM hash -> pdserve hash for the blocks vLLM holds."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._ours: dict[Hashable, int] = {}
        self.num_unchained = 0  # stored events whose parent block was unknown

    def translate(self, events: Iterable[Any]) -> Change:
        cleared = False
        stored: list[int] = []
        removed: list[int] = []
        for ev in events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                self._ours.clear()
                cleared, stored, removed = True, [], []
            elif _is_tier(ev):  # the connector's tiers: already pdserve hashes
                (stored if kind == "BlockStored" else removed).extend(
                    int(h) for h in ev.block_hashes)
            elif kind == "BlockStored":
                stored += self._stored(ev)
            elif kind == "BlockRemoved":
                removed += [h for vh in ev.block_hashes
                            if (h := self._ours.pop(_key(vh), None)) is not None]
        return cleared, stored, removed

    def _stored(self, ev: Any) -> list[int]:
        n = len(ev.block_hashes)
        if ev.block_size != self.block_size or len(ev.token_ids) != n * self.block_size:
            return []  # a partial block: vLLM's prefix matching ignores those too
        parent = salt_root(_first_block_salt(ev))
        if ev.parent_block_hash is not None:
            known = self._ours.get(_key(ev.parent_block_hash))
            if known is None:
                self.num_unchained += 1
                return []
            parent = known
        ours = chain_hashes(ev.token_ids, self.block_size, parent)
        for vh, h in zip(ev.block_hashes, ours, strict=True):
            self._ours[_key(vh)] = h
        return ours


def _first_block_salt(ev: Any) -> str | None:
    """The ``cache_salt`` vLLM hashed into a prompt's first block, from the event's
    untagged extra keys of that block: the LoRA name first when ``lora_name`` is set
    (pdserve serves none), then multimodal pairs (tuples), then the salt, the one
    string. None without one."""
    extra = getattr(ev, "extra_keys", None)
    if not extra or extra[0] is None:
        return None
    keys = list(extra[0])
    if getattr(ev, "lora_name", None) is not None and keys:
        keys = keys[1:]
    salts = [k for k in keys if isinstance(k, str)]
    return salts[0] if salts else None


def _is_tier(ev: Any) -> bool:
    """An event of pdserve's KV tiers (``medium`` ``pdserve:<tier>``): its hashes are
    pdserve hashes in the tier's namespace (``core.block_hash.tier_hashes``)."""
    medium = getattr(ev, "medium", None)
    return isinstance(medium, str) and medium.startswith("pdserve:")


def _key(vllm_hash: Any) -> Hashable:
    return bytes(vllm_hash) if isinstance(vllm_hash, bytearray | memoryview) else vllm_hash


class ZmqKvEventSource:
    """Subscribes to one engine's KV events on a daemon thread; calls ``sink`` on
    the event loop with each translated change, in order."""

    def __init__(self, endpoints: KvEventEndpoints, block_size: int,
                 sink: Callable[[bool, list[int], list[int]], object],
                 loop: asyncio.AbstractEventLoop) -> None:
        self._endpoints = endpoints
        self._translator = VllmEventTranslator(block_size)
        self._sink = sink
        self._loop = loop
        self._stop = threading.Event()
        self._next_seq = 0
        self.num_replayed = 0
        self.num_lost = 0
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self._endpoints.pub)
        try:
            while not self._stop.is_set():
                if not sub.poll(200):
                    continue
                _topic, seq_bytes, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq > self._next_seq:
                    self._replay(ctx, decoder, seq)
                if seq >= self._next_seq:
                    self._deliver(seq, decoder.decode(payload))
        except Exception:  # noqa: BLE001 - a dead source must say why, once
            logger.exception("KV event subscriber stopped")
        finally:
            sub.close(linger=0)

    def _replay(self, ctx: Any, decoder: Any, upto: int) -> None:
        """Fetch batches [next_seq, upto) from the publisher's replay buffer."""
        import zmq

        sock = ctx.socket(zmq.DEALER)
        sock.connect(self._endpoints.replay)
        try:
            sock.send_multipart([b"", self._next_seq.to_bytes(8, "big")])
            while sock.poll(_REPLAY_TIMEOUT_MS):
                _, _topic, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == _END_SEQ:
                    break
                if self._next_seq <= seq < upto:
                    self._deliver(seq, decoder.decode(payload))
                    self.num_replayed += 1
        finally:
            sock.close(linger=0)
        if self._next_seq < upto:
            self.num_lost += upto - self._next_seq
            logger.error("KV events %d..%d lost (not in the replay buffer); the prefix "
                         "index may be stale until blocks are stored again",
                         self._next_seq, upto - 1)
            self._next_seq = upto

    def _deliver(self, seq: int, batch: Any) -> None:
        self._next_seq = seq + 1
        cleared, stored, removed = self._translator.translate(batch.events)
        if cleared or stored or removed:
            self._loop.call_soon_threadsafe(self._sink, cleared, stored, removed)


@dataclass
class KvEventMirroring:
    """A running engine's KV events, kept in ``mirror`` (the host's, whatever its role)."""

    mirror: KvCacheMirror
    source: ZmqKvEventSource

    @classmethod
    def start(cls, endpoints: KvEventEndpoints, block_size: int,
              loop: asyncio.AbstractEventLoop) -> KvEventMirroring:
        """Subscribe (call on the event loop ``loop`` once the engine runs)."""
        mirror = KvCacheMirror(block_size)
        source = ZmqKvEventSource(endpoints, block_size, mirror.apply, loop)
        source.start()
        return cls(mirror, source)

    def close(self) -> None:
        self.source.close()
