"""The SSE bytes a client receives, byte for byte, against goldens recorded before the
router's streaming fast path (``tests/unit/golden/sse.json``): chat and completions,
with and without logprobs, tools, ``n``, usage, echo, stop strings, several tokens per
chunk, multi-byte characters split across tokens. Only ids and timestamps are masked.
Each case runs in-process (ASGI) and through a real uvicorn server, where the express
lane (``router/http/edge/express.py``) writes the plain chunks itself: the bytes are the
same, and the lane is shown to have carried them exactly where it applies.

The goldens were written by the router as it was before the fast path (``python
tests/unit/test_sse_golden.py`` rewrites them from the current code: do that only for a
change of the bytes that is meant, and say so in the commit).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

GOLDEN = Path(__file__).parent / "golden" / "sse.json"
TEXT = "Héllo wörld — 日本語 😀, done: END and more."
TOOL_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
             '</tool_call>')
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Say something."}]

# name -> (path, body, FakeDispatcher fields, tools)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any], bool]] = {
    "cmpl": ("/v1/completions", {"prompt": "Hello", "max_tokens": 40}, {}, False),
    "cmpl_usage_ids": ("/v1/completions", {
        "prompt": "Hello", "stream_options": {"include_usage": True},
        "return_token_ids": True}, {"num_cached_tokens": 3}, False),
    "cmpl_logprobs_echo": ("/v1/completions", {
        "prompt": "Hello there", "logprobs": 2, "echo": True, "max_tokens": 8},
        {"logprobs": True}, False),
    "cmpl_stop_n2": ("/v1/completions", {
        "prompt": "Hello", "stop": ["END"], "n": 2, "max_tokens": 40,
        "stream_options": {"include_usage": True}}, {"decode_worker_id": "d0"}, False),
    "cmpl_3_per_chunk_length": ("/v1/completions", {"prompt": "Hello", "max_tokens": 11},
                                {"tokens_per_chunk": 3}, False),
    "chat": ("/v1/chat/completions", {"messages": MESSAGES}, {}, False),
    "chat_usage_logprobs": ("/v1/chat/completions", {
        "messages": MESSAGES, "logprobs": True, "top_logprobs": 2,
        "stream_options": {"include_usage": True}}, {"logprobs": True}, False),
    "chat_n2_stop_ids": ("/v1/chat/completions", {
        "messages": MESSAGES, "n": 2, "stop": ["END"], "return_token_ids": True},
        {"decode_worker_id": "d0", "tokens_per_chunk": 2}, False),
    "chat_end_token": ("/v1/chat/completions", {"messages": MESSAGES, "return_token_ids": True},
                       {"end_token": 2}, False),
    "chat_tools": ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS,
                                            "stream_options": {"include_usage": True}},
                   {"text": TOOL_TEXT, "end_token": 2}, True),
}

_MASKS = [(re.compile(r'"id":"[^"]*"'), '"id":"X"'),
          (re.compile(r'"created":\d+'), '"created":0')]


def _mask(body: str) -> str:
    for pattern, replacement in _MASKS:
        body = pattern.sub(replacement, body)
    return body


# The cases whose later chunks are all plain text (one choice, no stop strings, no
# logprobs, no token ids, no tools): the express lane carries them through uvicorn.
EXPRESS = {"cmpl", "cmpl_3_per_chunk_length", "chat"}


async def _stream(tokenizer: Any, name: str, server: str = "asgi") -> str:
    from unit.fakes import ROUTER_MODEL, FakeDispatcher, asgi_http_client, serve_in_thread

    from pdserve.router.http.app import create_app
    from pdserve.router.http.openai.tool_calls import ToolCalling, ToolConfig

    path, body, fields, tools = CASES[name]
    fields = dict(fields)
    text = fields.pop("text", TEXT)
    ids = tokenizer.encode(text, add_special_tokens=False)
    fake = FakeDispatcher(output_ids=ids, **fields)
    calling = ToolCalling.load(ToolConfig("hermes", True), tokenizer) if tools else None
    app = create_app(served_model_name=ROUTER_MODEL, max_model_len=256, tokenizer=tokenizer,
                     dispatcher=fake, tool_calling=calling)
    request = {"model": ROUTER_MODEL, **body, "stream": True}
    if server == "asgi":
        async with asgi_http_client(app) as http:
            reply = await http.post(path, json=request)
    else:
        with serve_in_thread(app) as url:
            async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
                reply = await http.post(path, json=request)
        # Every token but the first chunk's and the last chunk's (11 in chunks of 3:
        # 3, 3, 3, 2).
        middle = {"cmpl_3_per_chunk_length": 11 - 3 - 2}.get(name, len(ids) - 2)
        assert fake.express_taken == (middle if name in EXPRESS else 0), name
    assert reply.status_code == 200, reply.text
    return _mask(reply.text)


@pytest.mark.parametrize("server", ["asgi", "uvicorn"])
@pytest.mark.parametrize("name", sorted(CASES))
async def test_the_sse_bytes_are_the_goldens(tokenizer: Any, name: str, server: str) -> None:
    golden = json.loads(GOLDEN.read_text())
    got = await _stream(tokenizer, name, server)
    assert got == golden[name]
    assert got.endswith("data: [DONE]\n\n")


def _write() -> None:  # pragma: no cover - run by hand
    from unit.fakes import default_tokenizer

    tokenizer = default_tokenizer()
    goldens = {name: asyncio.run(_stream(tokenizer, name)) for name in sorted(CASES)}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(goldens, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(goldens)} goldens to {GOLDEN}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[1]))
    _write()
