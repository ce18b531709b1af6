"""``StreamWriter`` (``router/http/openai/stream_writer.py``) against fake uvicorn cycles: it
takes a cycle only when every internal it reads is there with the type it expects
(checked once, in ``of``), and is not ``ready`` once the transport is closing, so the
express lane declines and the chunk takes the usual ``send`` path."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.router.http.openai.stream_writer import SERVER_SEND_KEY, StreamWriter


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closing


class _Flow:
    def __init__(self) -> None:
        self.write_paused = False


class _Cycle:
    """The fields of uvicorn's httptools ``RequestResponseCycle`` the writer reads."""

    def __init__(self) -> None:
        self.chunked_encoding: Any = True
        self.response_started: Any = True
        self.response_complete: Any = False
        self.disconnected: Any = False
        self.flow: Any = _Flow()
        self.transport: Any = _Transport()

    async def send(self, message: dict[str, Any]) -> None:
        return None


def _scope(cycle: _Cycle) -> dict[str, Any]:
    return {SERVER_SEND_KEY: cycle.send}


def test_a_cycle_with_the_expected_internals_is_written_to() -> None:
    cycle = _Cycle()
    writer = StreamWriter.of(_scope(cycle))
    assert writer is not None and writer.ready()
    writer.write(b"data: x\n\n")
    assert cycle.transport.written == [b"9\r\ndata: x\n\n\r\n"]


def _drop(name: str) -> Any:
    def change(cycle: _Cycle) -> None:
        delattr(cycle, name)
    return change


class _OldTransport:  # a transport without is_closing
    def write(self, data: bytes) -> None:
        raise AssertionError("never written")


CHANGES = {
    "no_response_started": _drop("response_started"),
    "no_response_complete": _drop("response_complete"),
    "no_disconnected": _drop("disconnected"),
    "no_flow": _drop("flow"),
    "no_transport": _drop("transport"),
    "response_started_not_bool": lambda c: setattr(c, "response_started", 1),
    "write_paused_renamed": lambda c: setattr(c, "flow", object()),
    "write_paused_not_bool": lambda c: setattr(c.flow, "write_paused", None),
    "transport_without_is_closing": lambda c: setattr(c, "transport", _OldTransport()),
    "not_chunked": lambda c: setattr(c, "chunked_encoding", False),
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_a_cycle_whose_internals_differ_gets_no_writer(change: Any) -> None:
    cycle = _Cycle()
    change(cycle)
    assert StreamWriter.of(_scope(cycle)) is None


def test_a_closing_transport_is_not_ready() -> None:
    cycle = _Cycle()
    writer = StreamWriter.of(_scope(cycle))
    assert writer is not None and writer.ready()
    cycle.transport.closing = True  # closed by uvicorn, or the peer reset it
    assert not writer.ready()
    cycle.transport.closing = False
    cycle.flow.write_paused = True
    assert not writer.ready()
