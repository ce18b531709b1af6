"""A minimal OpenAI-compatible engine for router benchmarks: no model, no tokenizer, a raw
asyncio HTTP/1.1 server (keep-alive, ``Content-Length`` bodies) that costs little CPU, so
that a router in front of it is what a CPU measurement sees.

``POST /v1/completions`` (or ``/v1/chat/completions``) with ``"stream": true`` answers
``max_tokens`` SSE chunks (``data: {...}``, chunked encoding) and ``data: [DONE]``: the
first at once, the others ``--ms-per-token`` apart, each stream on its own timer as
``pdserve sim-worker``'s decode is. Without ``stream``: one JSON answer after
``--step-ms`` (the sim prefill's fixed step, one answer at a time as the sim's), with
the ``kv_transfer_params`` a vLLM prefill engine returns. ``GET /health`` and
``/v1/models`` answer 200.

    python -m pdserve.bench.micro.router_cost.openai_stub --port 8100 --ms-per-token 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import cast

import uvloop

MODEL = "SmolLM2-135M-Instruct"
KV_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False,
             "remote_engine_id": "stub", "remote_block_ids": [0], "remote_host": "127.0.0.1",
             "remote_port": 1}
STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
               b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")


def _chunk(payload: bytes) -> bytes:
    """One HTTP chunk (chunked transfer encoding)."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(obj: object) -> bytes:
    return _chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


def _response(status: str, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
            % (status.encode(), ctype, len(body)) + body)


def _choice(chat: bool, finish: str | None, text: str) -> dict[str, object]:
    if chat:
        return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def _frame(request_id: str, chat: bool, finish: str | None) -> dict[str, object]:
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": MODEL,
            "choices": [_choice(chat, finish, " tok")]}


class Engine:
    """The pacing: ``ms_per_token`` between streamed chunks, ``step_ms`` per answer."""

    def __init__(self, ms_per_token: float, step_ms: float) -> None:
        self.token_s = ms_per_token / 1e3
        self.step_s = step_ms / 1e3
        self.num_requests = 0
        self.compute = asyncio.Lock()  # one answer at a time, as the sim prefill computes

    async def stream(self, transport: asyncio.Transport, chat: bool, max_tokens: int) -> None:
        self.num_requests += 1
        rid = f"cmpl-{self.num_requests}"
        token, last = _event(_frame(rid, chat, None)), _event(_frame(rid, chat, "length"))
        transport.write(STREAM_HEAD)
        for i in range(max_tokens):
            if i:
                await asyncio.sleep(self.token_s)
            if transport.is_closing():
                return
            transport.write(last if i == max_tokens - 1 else token)
        transport.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    async def answer(self, transport: asyncio.Transport, chat: bool, max_tokens: int) -> None:
        self.num_requests += 1
        async with self.compute:
            await asyncio.sleep(self.step_s)
        text = " tok" * max_tokens
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": "length"} if chat else _choice(False, "length", text))
        body = {"id": f"cmpl-{self.num_requests}", "object": "chat.completion" if chat
                else "text_completion", "created": int(time.time()), "model": MODEL,
                "choices": [choice], "kv_transfer_params": KV_PARAMS,
                "usage": {"prompt_tokens": 1, "completion_tokens": max_tokens,
                          "total_tokens": 1 + max_tokens}}
        if not transport.is_closing():
            transport.write(_response("200 OK", json.dumps(body).encode()))


class StubProtocol(asyncio.Protocol):
    """One connection: requests handled one after another (HTTP/1.1 keep-alive)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy: asyncio.Task[None] | None = None
        self.close_after = False  # the request said Connection: close

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream socket's transport (uvloop's is not an asyncio.Transport subclass).
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy is not None:
            self.busy.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.busy is None:
            self._next()

    def _next(self) -> None:
        head_end = self.buf.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = self.buf[:head_end].decode("latin-1").split("\r\n")
        length = 0
        for line in head[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection":
                self.close_after = value.strip().lower() == "close"
        if len(self.buf) < head_end + 4 + length:
            return
        body = self.buf[head_end + 4:head_end + 4 + length]
        self.buf = self.buf[head_end + 4 + length:]
        method, path = head[0].split(" ")[:2]
        self.busy = asyncio.ensure_future(self._serve(method, path.split("?")[0], body))
        self.busy.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.busy = None
        if self.transport is None or self.transport.is_closing():
            return
        if self.close_after:
            self.transport.close()
        elif self.buf:
            self._next()

    async def _serve(self, method: str, path: str, body: bytes) -> None:
        t = self.transport
        if t is None:
            return
        if method == "GET" and path == "/v1/models":
            t.write(_response("200 OK", json.dumps(
                {"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()))
        elif method == "GET":
            t.write(_response("200 OK", b"{}"))
        elif path in ("/v1/completions", "/v1/chat/completions"):
            req = json.loads(body or b"{}")
            chat = path.endswith("chat/completions")
            n = int(req.get("max_completion_tokens") or req.get("max_tokens") or 16)
            if req.get("stream"):
                await self.engine.stream(t, chat, n)
            else:
                await self.engine.answer(t, chat, n)
        else:
            t.write(_response("404 Not Found", b'{"error":"not found"}'))


async def serve(host: str, port: int, engine: Engine) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: StubProtocol(engine), host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ms-per-token", type=float, default=20.0)
    p.add_argument("--step-ms", type=float, default=2.0)
    args = p.parse_args(argv)
    uvloop.run(serve(args.host, args.port, Engine(args.ms_per_token, args.step_ms)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
