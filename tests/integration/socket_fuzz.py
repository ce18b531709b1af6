"""The HTTP fuzz's inputs and tally, through real sockets (``test_http_fuzz_sockets.py``).

A port's routes come from its own ``/openapi.json`` (Schemathesis draws cases, positive
and negative, for each operation it lists); ``pdserve.bench.fuzz.http_bodies`` gives
the raw bodies (the in-process fuzz's, ``tests/unit/test_fuzz_router_http.py``); and
``JUNK`` is what no client library sends: broken request lines, framing and headers,
pipelined requests, a client that leaves. Every input is sent once, on a connection of
its own, under one of the port's credentials in turn (right, wrong, none).
"""

from __future__ import annotations

import random
import re
import socket
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.result import Ok

from pdserve.bench.fuzz.http_bodies import bodies, is_openai_error

TIMEOUT_S = 30.0
_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")
_CRLF = b"\r\n"


@dataclass(frozen=True)
class Port:
    """One listener: its base URL, whether its routes are OpenAI ones (refusals must be
    OpenAI error JSON), and the credentials to try (None: no header)."""

    label: str
    url: str
    openai: bool
    keys: tuple[str | None, ...] = (None,)

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    def headers(self, index: int) -> dict[str, str]:
        key = self.keys[index % len(self.keys)]
        return {} if key is None else {"authorization": f"Bearer {key}"}


@dataclass
class Tally:
    """What one port answered."""

    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)  # a 5xx, or a refusal not OpenAI's
    timeouts: list[str] = field(default_factory=list)
    # A 5xx the route documents, as OpenAI error JSON (a weight update whose own deadline
    # passed on the workers: 503): an answer, not a crash; listed in the report.
    documented_5xx: list[str] = field(default_factory=list)

    def note(self, what: str, status: int, body: bytes, openai_route: bool,
             documented: frozenset[int] = frozenset()) -> None:
        self.sent += 1
        self.statuses[status] += 1
        if status >= 500 and status != 500 and status in documented and _openai_error(body):
            self.documented_5xx.append(f"{status} {what[:200]}: {body[:300]!r}")
        elif status >= 500:
            self.crashes.append(f"{status} {what[:200]}: {body[:300]!r}")
        elif status >= 400 and openai_route and not _openai_error(body):
            self.crashes.append(f"{status} not OpenAI error JSON {what[:200]}: {body[:300]!r}")

    def report(self, port: Port) -> str:
        return (f"{port.label}: {self.sent} inputs, statuses {dict(sorted(self.statuses.items()))}"
                f", {len(self.crashes)} crashes, {len(self.timeouts)} timeouts"
                + "".join(f"\n  documented {line}" for line in self.documented_5xx))


def _openai_error(body: bytes) -> bool:
    try:
        return is_openai_error(httpx.Response(200, content=body).json())
    except ValueError:
        return False


def schema_cases(schema: dict[str, Any], num: int, seed: int,
                 prepare: Callable[[Any], None]) -> list[Any]:
    """About ``num`` Schemathesis cases over every operation ``schema`` lists, positive
    and negative ones, drawn with a fixed seed; ``prepare`` edits each (the model name)."""
    loaded = schemathesis.openapi.from_dict(schema)
    # every operation loads (an Err has no ok(): it fails here)
    operations = [cast("Ok[Any]", result).ok() for result in loaded.get_all_operations()]
    strategy = st.one_of([op.as_strategy(mode) for op in operations
                          for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])
    cases: list[Any] = []

    @given(case=strategy)
    @settings(max_examples=num, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    def draw(case: Any) -> None:
        prepare(case)
        cases.append(case)

    random.seed(seed)
    draw()
    return cases


def send_case(client: httpx.Client, port: Port, case: Any, index: int,
              tally: Tally) -> None:
    kwargs = case.as_transport_kwargs(base_url=port.url)
    body = {"json": kwargs["json"]} if "json" in kwargs else (
        {"content": kwargs["data"]} if isinstance(kwargs.get("data"), bytes | str) else {})
    headers = {**(kwargs.get("headers") or {}), **port.headers(index)}
    if kwargs.get("cookies"):
        headers["cookie"] = "; ".join(f"{k}={v}" for k, v in kwargs["cookies"].items())
    what = f"{kwargs['method']} {kwargs['url']} {str(body)[:120]}"
    try:
        reply = client.request(kwargs["method"], kwargs["url"], headers=headers,
                               params=kwargs.get("params"), **body)
    except httpx.TimeoutException:
        tally.timeouts.append(what)
        return
    except httpx.HTTPError as exc:  # refused on the socket (a header h11 will not send)
        tally.note(what, 0, str(exc).encode(), False)
        return
    documented = frozenset(int(s) for s in case.operation.definition.raw.get("responses", {})
                           if s.isdigit())
    tally.note(what, reply.status_code, reply.content,
               port.openai and kwargs["url"].removeprefix(port.url).startswith("/v1/"),
               documented)


def send_raw_bodies(client: httpx.Client, port: Port, paths: Sequence[str], model: str,
                    num: int, tally: Tally, seed: int) -> None:
    """``http_bodies``' raw bodies (``num`` in all), POSTed to ``paths`` in turn."""
    raws = bodies(random.Random(seed), model, num // 2 + 1)[:num]

    def send(item: tuple[int, Any]) -> None:
        index, raw = item
        path = paths[index % len(paths)] if port.label.startswith("admin") else raw.path
        headers = port.headers(index)
        if raw.content_type is not None:
            headers["content-type"] = raw.content_type
        try:
            reply = client.post(port.url + path, content=raw.content, headers=headers)
        except httpx.TimeoutException:
            tally.timeouts.append(f"{raw.cls} {path}")
            return
        tally.note(f"raw {raw.cls} {path} {raw.content[:80]!r}", reply.status_code,
                   reply.content, port.openai and path.startswith("/v1/"))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, enumerate(raws)))


def _request(path: str, body: bytes, extra: bytes = b"", auth: bytes = b"") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\n" + auth + extra
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def junk(path: str, valid: bytes, auth: bytes) -> list[tuple[str, bytes, bool]]:
    """(name, bytes, whether to close at once after sending) for one port's ``path``
    (a POST route) and a ``valid`` body for it."""
    head = b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + auth
    return [
        ("garbage_line", b"GARBAGE\r\n\r\n", False),
        ("http_9", b"GET / HTTP/9.9\r\nHost: x\r\n\r\n", False),
        ("no_host_1_0", b"GET /health HTTP/1.0\r\n\r\n", False),
        ("negative_length", head + b"Content-Length: -1\r\n\r\n", False),
        ("length_not_a_number", head + b"Content-Length: 12ab\r\n\r\n{}", False),
        ("two_lengths", head + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", False),
        ("length_and_chunked", head + b"Content-Length: 2\r\nTransfer-Encoding: chunked"
         b"\r\n\r\n0\r\n\r\n", False),
        ("bad_chunk_size", head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
         False),
        ("chunked_json", head + b"Transfer-Encoding: chunked\r\nContent-Type: application/json"
         b"\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(valid), valid), False),
        ("header_no_colon", head + b"X-Broken-Header\r\nContent-Length: 2\r\n\r\n{}", False),
        ("header_nul", head + b"X-A: a\x00b\r\nContent-Length: 2\r\n\r\n{}", False),
        ("header_100k", head + b"X-Big: " + b"a" * 100_000 + b"\r\nContent-Length: 2\r\n\r\n{}",
         False),
        ("url_70k", b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", False),
        ("url_bytes", b"GET /v1/\xff\xfe%00%zz HTTP/1.1\r\nHost: x\r\n\r\n", False),
        ("absolute_uri", b"GET http://evil/health HTTP/1.1\r\nHost: x\r\n\r\n", False),
        ("body_cut_short", _request(path, valid, auth=auth)[:-5], True),
        ("length_past_body", head + b"Content-Type: application/json\r\nContent-Length: 999"
         b"\r\n\r\n" + valid, True),
        ("pipelined_valid_then_junk", _request(path, valid, auth=auth) + b"JUNK\r\n\r\n", False),
        ("pipelined_two_then_leave", _request(path, valid, auth=auth) * 2, True),
        ("pipelined_ten", _request(path, valid, auth=auth) * 10, False),
        ("leave_mid_headers", head + b"Content-Le", True),
        ("expect_100", head + b"Expect: 100-continue\r\nContent-Type: application/json\r\n"
         b"Content-Length: %d\r\n\r\n" % len(valid) + valid, False),
        ("body_2mib", _request(path, b'{"a": "' + b"x" * (2 << 20) + b'"}', auth=auth), False),
    ]


def send_junk(port: Port, path: str, valid: bytes, tally: Tally) -> None:
    """Each of ``junk``'s inputs on a connection of its own (under the port's credentials
    in turn), all at once: each exchange ends on ``_exchange``'s 2 s of silence, which
    one after another cost ~24 s a port pair; every status line in the answer is
    tallied (0: closed without one), in ``junk``'s order."""
    variants: dict[bytes, list[tuple[str, bytes, bool]]] = {}
    inputs: list[tuple[str, bytes, bool]] = []
    for index in range(len(junk(path, valid, b""))):
        auth = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode())
                        for k, v in port.headers(index).items())
        inputs.append(variants.setdefault(auth, junk(path, valid, auth))[index])
    with ThreadPoolExecutor(len(inputs)) as pool:
        answers = list(pool.map(lambda item: _exchange(port.host_port, item[1], item[2]),
                                inputs))
    for (name, _, _), answer in zip(inputs, answers, strict=True):
        statuses = [int(s) for s in _STATUS.findall(answer)] or [0]
        for status in statuses:
            # uvicorn's own refusals (bad framing) are plain text: only a route's are OpenAI's
            tally.note(f"junk {name}", status, answer, False)


def _exchange(address: tuple[str, int], raw: bytes, leave: bool) -> bytes:
    with socket.create_connection(address, timeout=TIMEOUT_S) as conn:
        try:
            conn.sendall(raw)
        except OSError:  # the server closed first (it refused the head): read its answer
            pass
        if leave:
            return b""
        conn.settimeout(2.0)  # a kept-alive connection answers no more after this
        answer = b""
        try:
            while data := conn.recv(65536):
                answer += data
        except (TimeoutError, ConnectionResetError):
            pass  # kept alive, or reset after an answer: what came is the answer
        return answer
