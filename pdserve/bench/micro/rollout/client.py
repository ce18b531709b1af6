"""The rollout bench's HTTP side: the router's OpenAI API (a batch of ``n``-sample chat
completions, streamed requests timed per token) and its admin listener (the weight
update, ``/weight_info``), one ``httpx.AsyncClient`` for each, every call under the
bench's deadline. What a response must carry (``system_fingerprint`` and the
``x-weight-version`` header, both the weight version that produced it) is checked here
for batches and answers, and recorded for streams (``report.py`` checks them).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import httpx

from pdserve.bench.micro.rollout.report import RolloutCheckError, StreamRecord
from pdserve.bench.workload.prompts import Messages

VERSION_HEADER = "x-weight-version"
MISSING = "(missing)"


class Failable(Protocol):
    error: str


async def sse_chunks(reply: httpx.Response, into: Failable) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI stream; none, with ``into.error`` set, on an answer
    other than 200 or from an SSE error event on."""
    if reply.status_code != 200:
        into.error = (await reply.aread()).decode(errors="replace")[:300]
        return
    async for line in reply.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line.removeprefix("data: "))
        if "error" in chunk:
            into.error = f"SSE error: {json.dumps(chunk['error'])[:300]}"
            return
        yield chunk


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _detail(reply: httpx.Response) -> str:
    return reply.text[:300].replace("\n", " ")


class RolloutClient:
    """``url``: the router (``http://host:port``); ``admin_url``: its admin listener.
    Use as an async context manager (closes both HTTP clients). ``transport``: both
    clients' (tests hand in an ``httpx.ASGITransport`` of a fake router)."""

    def __init__(self, url: str, admin_url: str, api_key: str | None,
                 admin_key: str | None, deadline_s: float,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.deadline_s = deadline_s
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        self.api = httpx.AsyncClient(base_url=url.rstrip("/"), headers=_auth(api_key),
                                     timeout=deadline_s, limits=limits, transport=transport)
        self.admin = httpx.AsyncClient(base_url=admin_url.rstrip("/"),
                                       headers=_auth(admin_key), timeout=deadline_s,
                                       transport=transport)
        self.model = ""

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.api.aclose()
        await self.admin.aclose()

    async def resolve_model(self) -> str:
        """The served model's name (``/v1/models``' first), kept for every request."""
        async with asyncio.timeout(self.deadline_s):
            reply = await self.api.get("/v1/models")
        if reply.status_code != 200 or not reply.json().get("data"):
            raise RolloutCheckError(f"/v1/models: HTTP {reply.status_code} {_detail(reply)}")
        self.model = str(reply.json()["data"][0]["id"])
        return self.model

    async def weight_info(self) -> dict[str, Any]:
        async with asyncio.timeout(self.deadline_s):
            reply = await self.admin.get("/weight_info")
        if reply.status_code != 200:
            raise RolloutCheckError(f"/weight_info: HTTP {reply.status_code} {_detail(reply)}")
        return dict(reply.json())

    def _body(self, messages: Messages, max_tokens: int, temperature: float, seed: int,
              **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": temperature, "seed": seed, **extra}

    async def generate(self, messages: Messages, n: int, max_tokens: int,
                       temperature: float, seed: int, expect: str) -> int:
        """One ``n``-sample completion that must come from version ``expect``; its
        completion tokens."""
        body = self._body(messages, max_tokens, temperature, seed, n=n)
        async with asyncio.timeout(self.deadline_s):
            reply = await self.api.post("/v1/chat/completions", json=body)
        if reply.status_code != 200:
            raise RolloutCheckError(f"a batch request: HTTP {reply.status_code} "
                                    f"{_detail(reply)}")
        answer = reply.json()
        versions = {answer.get("system_fingerprint"), reply.headers.get(VERSION_HEADER)}
        if versions != {expect}:
            raise RolloutCheckError(f"a batch request came from {sorted(map(str, versions))} "
                                    f"(system_fingerprint, {VERSION_HEADER}); expected "
                                    f"{expect!r}")
        if len(answer.get("choices", ())) != n:
            raise RolloutCheckError(f"a batch request asked for n={n} and got "
                                    f"{len(answer.get('choices', ()))} choices")
        return int(answer["usage"]["completion_tokens"])

    async def stream(self, messages: Messages, max_tokens: int, temperature: float,
                     seed: int) -> StreamRecord:
        """One streamed completion, recorded (never raises for the server's answer)."""
        record = StreamRecord(started_s=time.monotonic())
        body = self._body(messages, max_tokens, temperature, seed, stream=True,
                          return_token_ids=True)
        try:
            async with asyncio.timeout(self.deadline_s):
                await self._read_stream(body, record)
        except TimeoutError:
            record.error = f"no end within {self.deadline_s:.0f} s"
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.ended_s = time.monotonic()
        return record

    async def _read_stream(self, body: dict[str, Any], record: StreamRecord) -> None:
        async with self.api.stream("POST", "/v1/chat/completions", json=body) as reply:
            record.status = reply.status_code
            record.header_version = reply.headers.get(VERSION_HEADER)
            async for chunk in sse_chunks(reply, record):
                record.chunk_versions.add(chunk.get("system_fingerprint") or MISSING)
                tokens = sum(_chunk_tokens(c) for c in chunk.get("choices", ()))
                if tokens:
                    record.events.append((time.monotonic(), tokens))

    async def update(self, model_path: str, version: str, policy: str,
                     drain_timeout_s: float | None) -> dict[str, Any]:
        """``POST /update_weights_from_disk``; its answer, checked: success, the new
        version, every worker on it."""
        body: dict[str, Any] = {"model_path": model_path, "weight_version": version,
                                "policy": policy}
        if drain_timeout_s is not None:
            body["drain_timeout_s"] = drain_timeout_s
        async with asyncio.timeout(self.deadline_s):
            reply = await self.admin.post("/update_weights_from_disk", json=body)
        if reply.status_code != 200 or not reply.json().get("success"):
            raise RolloutCheckError(f"update to {version!r} ({model_path}): HTTP "
                                    f"{reply.status_code} {_detail(reply)}")
        answer = dict(reply.json())
        check_all_on(answer, version, "the update's answer")
        return answer


def check_all_on(answer: dict[str, Any], version: str, what: str) -> None:
    """``answer`` (an update's, or ``/weight_info``'s) says the cluster and each of its
    workers are on ``version``."""
    workers = answer.get("workers") or {}
    off = {w: v for w, v in workers.items() if v != version}
    if answer.get("weight_version") != version or off or not workers:
        raise RolloutCheckError(f"{what}: version {answer.get('weight_version')!r}, workers "
                                f"{workers}; expected every worker on {version!r}")


def _chunk_tokens(choice: dict[str, Any]) -> int:
    """A chunk choice's tokens: its ``token_ids`` (``return_token_ids``), else one if it
    carries text."""
    if "token_ids" in choice and choice["token_ids"] is not None:
        return len(choice["token_ids"])
    delta = choice.get("delta") or {}
    return 1 if delta.get("content") or choice.get("text") else 0


class BackgroundLoad:
    """``streams`` loops of streamed chat requests over ``prompts`` until ``stop``;
    every response is kept in ``records`` (failures too: the report checks them), and
    each loop's first in ``firsts`` (``warm_s``: when the load is at full strength)."""

    def __init__(self, client: RolloutClient, prompts: Sequence[Messages], streams: int,
                 max_tokens: int, temperature: float, seed: int) -> None:
        self.client, self.prompts, self.streams = client, prompts, streams
        self.max_tokens, self.temperature, self.seed = max_tokens, temperature, seed
        self.records: list[StreamRecord] = []
        self.firsts: list[StreamRecord] = []
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(i)) for i in range(self.streams)]

    async def _loop(self, index: int) -> None:
        sent = 0
        while not self._stopping.is_set():
            prompt = self.prompts[(index + sent * self.streams) % len(self.prompts)]
            record = await self.client.stream(prompt, self.max_tokens, self.temperature,
                                              self.seed + sent)
            self.records.append(record)
            if not sent:
                self.firsts.append(record)
            sent += 1

    def warm_s(self, started_s: float) -> float:
        """When every loop had its first token (``started_s`` if one never did: the
        checks fail that run anyway): the windows before it would read low."""
        firsts = [r.first_token_s for r in self.firsts if r.events]
        return max(firsts) if len(firsts) == self.streams else started_s

    def cancel(self) -> None:
        """Abandon the streams (a check already failed the run)."""
        self._stopping.set()
        for task in self._tasks:
            task.cancel()

    async def stop(self) -> list[StreamRecord]:
        """No new requests; waits for those in flight (each under the client's
        deadline) and returns every record."""
        self._stopping.set()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.client.deadline_s + 5)
        for task in self._tasks:
            task.cancel()
        return self.records
