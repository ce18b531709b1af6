"""``VllmEngine``'s side of the host's reports, without vLLM: its KV events mirrored from
the endpoints vLLM publishes on (once, until it shuts down), none where it publishes none."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.worker.kv.mirror import KvCacheMirror
from pdserve.worker.vllm import engine as vllm_engine
from pdserve.worker.vllm.kv_events import KvEventEndpoints
from pdserve.worker.vllm.kv_status import ConnectorStatus


def test_vllms_kv_events_are_mirrored_from_its_endpoints_until_it_shuts_down(
        monkeypatch: pytest.MonkeyPatch) -> None:
    started_with: list[tuple[KvEventEndpoints, int]] = []
    mirrorings: list[Any] = []

    class Mirroring:  # vLLM's ZMQ subscriber is test_kv_events_vllm.py's
        def __init__(self) -> None:
            self.mirror, self.closed = KvCacheMirror(128), False

        @classmethod
        def start(cls, endpoints: KvEventEndpoints, block_size: int,
                  loop: asyncio.AbstractEventLoop) -> Mirroring:
            started_with.append((endpoints, block_size))
            mirrorings.append(cls())
            return mirrorings[-1]

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(vllm_engine, "KvEventMirroring", Mirroring)
    llm = SimpleNamespace(vllm_config=SimpleNamespace(
        cache_config=SimpleNamespace(block_size=128)), shutdown=lambda: None)
    events = KvEventEndpoints("ipc:///tmp/pdserve-test-kvev.pub",
                              "ipc:///tmp/pdserve-test-kvev.replay")
    status = ConnectorStatus(ConnectorConfig(engine_id="w0"))
    engine = vllm_engine.VllmEngine(cast(Any, llm), status, events)
    loop = asyncio.new_event_loop()
    try:
        mirror = engine.mirror_kv_events(loop)
        assert mirror is not None and engine.mirror_kv_events(loop) is mirror
    finally:
        loop.close()
    assert started_with == [(events, 128)]
    engine.shutdown()
    assert mirrorings[0].closed
    assert vllm_engine.VllmEngine(cast(Any, llm), status).mirror_kv_events(loop) is None
