"""The proxy in front of vLLM's own disaggregated serving (``vllm-disagg`` in compare).

vLLM ships only a test script for this (``toy_proxy_server.py`` in its tests); this is
the same protocol: each request goes first to the prefill engine with one output token
and ``kv_transfer_params.do_remote_decode`` (the engine keeps the prompt's KV blocks and
answers where to read them), then, with those ``kv_transfer_params``, to the decode
engine, which reads the KV over NIXL and streams the answer back through here.

    pdserve bench disagg-proxy --port 8000 --prefill URL --decode URL
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False,
                 "remote_engine_id": None, "remote_block_ids": None,
                 "remote_host": None, "remote_port": None}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill engine gets it: one token, not streamed, KV kept."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out.update(max_tokens=1, kv_transfer_params=dict(REMOTE_DECODE))
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def build_app(prefill: str, decode: str, timeout_s: float = 900.0,
              transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """``transport``: for tests (fake engines); default: the network."""
    clients: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        for role, url in (("prefill", prefill), ("decode", decode)):
            clients[role] = httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits,
                                              transport=transport)
        yield
        for client in clients.values():
            await client.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.get("/v1/models")
    async def models() -> Response:
        """The decode engine's list, once both engines answer (503 until then)."""
        try:
            await clients["prefill"].get("/v1/models")
            resp = await clients["decode"].get("/v1/models")
        except httpx.HTTPError as exc:
            return JSONResponse({"error": f"engine not reachable: {exc}"}, 503)
        return Response(resp.content, resp.status_code, media_type="application/json")

    async def generate(path: str, request: Request) -> Response:
        body = await request.json()
        first = await clients["prefill"].post(path, json=prefill_body(body))
        if first.status_code != 200:
            return Response(first.content, first.status_code, media_type="application/json")
        body = dict(body, kv_transfer_params=first.json().get("kv_transfer_params"))
        if not body.get("stream"):
            resp = await clients["decode"].post(path, json=body)
            return JSONResponse(resp.json(), resp.status_code)
        upstream = await clients["decode"].send(
            clients["decode"].build_request("POST", path, json=body), stream=True)
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, upstream.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_bytes():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate("/v1/chat/completions", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate("/v1/completions", request)

    return app


def serve(prefill: str, decode: str, port: int, host: str = "127.0.0.1") -> None:
    """Run the proxy until stopped (``pdserve bench disagg-proxy``)."""
    uvicorn.run(build_app(prefill, decode), host=host, port=port, log_level="warning")
