"""The router's weights gate (``router/dispatch/weights.py``): requests wait while an
update runs and are admitted under the version it ends on; an update waits for (or
marks) the requests in flight."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from unit.fakes import ROUTER_MODEL, chat_body, cmpl_body

from pdserve.router.dispatch.base import Deadline, DeadlineExceededError
from pdserve.router.dispatch.weight_board import Published
from pdserve.router.dispatch.weights import WeightGate
from pdserve.router.http.openai.preprocess import GenerationRequest, Preprocessor
from pdserve.router.http.openai.schemas import ChatCompletionRequest, CompletionRequest


async def test_a_request_arriving_during_an_update_runs_under_the_new_version() -> None:
    gate = WeightGate("v1")
    gate.close()
    admitted: list[str] = []

    async def request() -> None:
        async with gate.admitted("r1", Deadline.after(5)) as ticket:
            admitted.append(ticket.version)

    task = asyncio.create_task(request())
    await asyncio.sleep(0.05)
    assert admitted == [] and gate.paused
    gate.reopen(Published("v2"))
    await asyncio.wait_for(task, 1)
    assert admitted == ["v2"] and not gate.paused


async def test_a_closed_gate_ends_a_waiting_request_at_its_deadline() -> None:
    gate = WeightGate("v1")
    gate.close()
    with pytest.raises(DeadlineExceededError, match="weight update"):
        async with gate.admitted("r1", Deadline.after(0.05)):
            pass


async def test_an_update_waits_for_the_running_requests_or_marks_them_aborted() -> None:
    gate = WeightGate("v1")
    release = asyncio.Event()

    async def request(request_id: str) -> bool:
        async with gate.admitted(request_id, Deadline.after(5)) as ticket:
            await release.wait()
            return ticket.aborted

    tasks = [asyncio.create_task(request(f"r{i}")) for i in range(3)]
    await asyncio.sleep(0.05)
    gate.close()
    assert not await gate.wait_idle(0.05)  # three still run
    assert [t.request_id for t in gate.abort(["r1"])] == ["r1"]
    release.set()
    assert await gate.wait_idle(1.0)
    assert [await t for t in tasks] == [False, True, False]
    assert gate.running == []


async def test_abort_by_id_reaches_every_choice_of_an_n_request() -> None:
    gate = WeightGate("v1")
    async with gate.admitted("req-0", Deadline.after(5)), \
            gate.admitted("req-1", Deadline.after(5)), gate.admitted("other", Deadline.after(5)):
        assert sorted(t.request_id for t in gate.abort(["req"])) == ["req-0", "req-1"]


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
@pytest.mark.parametrize("n", [1, 2])
async def test_an_abort_finds_a_request_by_the_ids_its_client_knows(
        tokenizer: Any, endpoint: str, n: int) -> None:
    """The workers' id of a request adds 128 random bits to the response id: an abort by
    the response id the client saw, or by its ``X-Request-Id``, still finds it (and
    every choice of it), and no other request."""
    preprocessor = Preprocessor(served_model_name=ROUTER_MODEL, max_model_len=4096,
                                tokenizer=tokenizer)
    build: Callable[[Any, str], GenerationRequest] = (
        preprocessor.completion if endpoint == "completion" else preprocessor.chat)
    body = (CompletionRequest(**cmpl_body(n=n)) if endpoint == "completion"
            else ChatCompletionRequest(**chat_body(n=n)))
    mine = build(body, "my-client-id")
    other = build(body.model_copy(), "someone-else")
    assert mine.request_id.startswith(f"{mine.response_id}.")
    ids = [mine.request_id] if n == 1 else [f"{mine.request_id}-{i}" for i in range(n)]
    for name in (mine.response_id, "my-client-id", *ids[:1]):
        gate = WeightGate("v1")
        async with contextlib.AsyncExitStack() as stack:
            for request_id in (*ids, other.request_id):
                await stack.enter_async_context(gate.admitted(request_id, Deadline.after(5)))
            aborted = gate.abort([name])
        expected = ids if name != ids[0] or n == 1 else ids[:1]
        assert sorted(t.request_id for t in aborted) == sorted(expected), name
