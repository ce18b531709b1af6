"""A streaming client cheap enough not to be the bottleneck, and the statistics of what
it saw. An HTTP library's client costs more CPU per streamed chunk than the router it
measures (and would fill the cores it shares with it); this one writes a raw HTTP/1.1
request on a connection of its own and only counts ``data: {`` per read, stamping each
event with the read's time.

``CpuMeter`` reads the CPU time of named process trees (a process and all of its
descendants: ``pdserve router --processes N``'s parent only supervises its children).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import psutil

MARK = b"data: {"
DONE = b"data: [DONE]"
MODEL = "SmolLM2-135M-Instruct"
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. " * 4


@dataclass
class StreamResult:
    """One streamed request: when it was sent, one stamp per ``data: {`` event (the
    time of the read that brought it), whether it got a 200 and ``[DONE]`` (``ok``),
    and whether it ended at all (``ended``: not cancelled by the caller)."""

    start: float
    stamps: list[float] = field(default_factory=list)
    ok: bool = False
    ended: bool = False

    @property
    def ttft(self) -> float | None:
        return self.stamps[0] - self.start if self.stamps else None


def post_bytes(port: int, path: str, body: Mapping[str, object]) -> bytes:
    """An HTTP/1.1 POST of ``body`` as JSON, on a connection closed after the answer."""
    data = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n"
            % (path.encode(), port, len(data)) + data)


def request_bytes(port: int, max_tokens: int) -> bytes:
    """A streamed completions request (``ignore_eos``: exactly ``max_tokens`` tokens)."""
    return post_bytes(port, "/v1/completions", {
        "model": MODEL, "prompt": PROMPT_TEXT, "max_tokens": max_tokens, "stream": True,
        "ignore_eos": True})


async def stream(port: int, request: bytes, timeout_s: float,
                 result: StreamResult | None = None) -> StreamResult:
    """Send ``request`` on a new connection and stamp its events into ``result`` (a new
    one by default) until ``[DONE]``, the connection's end or ``timeout_s``; never
    raises for what the server does."""
    result = result or StreamResult(time.perf_counter())
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            mark_tail = done_tail = b""  # what may begin a marker the next read ends
            status_ok: bool | None = None
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                now = time.perf_counter()
                if status_ok is None:
                    status_ok = data.startswith(b"HTTP/1.1 200")
                marks, done = mark_tail + data, done_tail + data
                result.stamps.extend([now] * marks.count(MARK))
                if DONE in done:
                    result.ok = status_ok
                    break
                mark_tail, done_tail = marks[-(len(MARK) - 1):], done[-(len(DONE) - 1):]
    except (OSError, TimeoutError):
        pass
    finally:
        if writer is not None:
            writer.close()
    result.ended = True
    return result


async def exchange(port: int, request: bytes, timeout_s: float) -> bytes:
    """Send ``request`` (``Connection: close``) and read the answer to its end."""
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            return await reader.read(-1)
        finally:
            writer.close()


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank below); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def itls(results: Iterable[StreamResult], lo: float = float("-inf"),
         hi: float = float("inf")) -> list[float]:
    """Gaps between consecutive events of each stream (from its first event on), those
    with both ends in ``[lo, hi]``."""
    out: list[float] = []
    for r in results:
        s = r.stamps
        out += [b - a for a, b in zip(s, s[1:], strict=False) if a >= lo and b <= hi]
    return out


def stream_stats(results: Sequence[StreamResult], lo: float = float("-inf"),
                 hi: float = float("inf")) -> dict[str, float]:
    """TTFT of the streams that started in ``[lo, hi]`` and ITL within it (ms): p50, p99,
    the largest gap; and the events, streams and failures counted."""
    started = [r for r in results if lo <= r.start <= hi]
    ttft = [t for r in started if (t := r.ttft) is not None]
    gaps = itls(results, lo, hi)
    return {"ttft_p50_ms": 1e3 * pct(ttft, 0.5), "ttft_p99_ms": 1e3 * pct(ttft, 0.99),
            "itl_p50_ms": 1e3 * pct(gaps, 0.5), "itl_p99_ms": 1e3 * pct(gaps, 0.99),
            "max_gap_ms": 1e3 * max(gaps, default=float("nan")),
            "num_events": float(sum(len(r.stamps) for r in results)),
            "num_streams": float(len(results)),
            "num_failed": float(sum(not r.ok for r in results))}


def per_token_and_request(short: tuple[float, int, int], long: tuple[float, int, int]
                          ) -> tuple[float, float]:
    """(CPU s per token, CPU s per request) from two passes, each (CPU s, tokens,
    requests): solves cpu = requests * r + tokens * t for r and t."""
    (c1, k1, n1), (c2, k2, n2) = short, long
    det = n1 * k2 - n2 * k1
    if det == 0:
        raise ValueError("the two passes must differ in tokens per request")
    return (n1 * c2 - n2 * c1) / det, (c1 * k2 - c2 * k1) / det


def _tree_cpu_s(pid: int) -> float:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


class CpuMeter:
    """CPU seconds of named groups of process trees, and of this process alone (its
    children are the processes under test), read together."""

    def __init__(self, groups: Mapping[str, Sequence[int]], own: str = "client") -> None:
        self.groups = {name: tuple(pids) for name, pids in groups.items()}
        self.own = own

    def read(self) -> dict[str, float]:
        t = psutil.Process().cpu_times()
        return {**{name: sum(_tree_cpu_s(p) for p in pids)
                   for name, pids in self.groups.items()}, self.own: t.user + t.system}

    @staticmethod
    def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
        return {name: after[name] - before[name] for name in before}
