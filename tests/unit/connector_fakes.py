"""What the connector's store and pool tests share: a request as vLLM's scheduler hands
it to the connector (the fields it reads), and waiting for the worker side to report a
request's load finished."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.kv_transfer.worker_side import WorkerSide


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def poll_until_finished(side: WorkerSide, req_id: str, timeout_s: float = 10.0
                        ) -> tuple[set[str], set[str]]:
    """``side.poll()`` until ``req_id`` is among the finished loads: (finished, failed)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        _, recving, failed = side.poll()
        if req_id in recving:
            return recving, failed
        time.sleep(0.01)
    raise AssertionError(f"{req_id} never finished")
