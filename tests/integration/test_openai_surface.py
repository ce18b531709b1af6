"""The OpenAI request surface through P/D, against one aggregated ``vllm serve`` of the
same model on the same machine (float32, greedy where it applies, both with
``--enable-auto-tool-choice --tool-call-parser hermes``).

Each feature goes through both paths of the tcp cluster (``--disagg auto``): a short
prompt that its decode worker prefills (``local``), a long one that a prefill worker
computes and hands over (``remote``: the first token, its logprobs and the grammar's first
step come from prefill, the rest from decode). The ``x-pdserve-disagg`` header proves
which path each request took.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import httpx
import jsonschema
import openai
import pydantic
import pytest
from integration.pd_cases import LONG, MODEL
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam
from pdserve_testing import Server

pytestmark = pytest.mark.integration

LOGPROB_TOLERANCE = 1e-4
SHORT = "Write one sentence about rivers."
PATHS = ("local", "remote")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                          "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def prompt_for(path: str) -> str:
    return SHORT if path == "local" else LONG + "\n\n" + SHORT


def chat(path: str, text: str | None = None) -> list[dict[str, str]]:
    return [{"role": "user", "content": (text or "") + prompt_for(path)}]


def post(base_url: str, route: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The JSON answer (non-streaming) and the disaggregation header ("" on vLLM)."""
    reply = httpx.post(f"{base_url}/{route}", json={"model": MODEL, **body}, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json(), reply.headers.get("x-pdserve-disagg", "")


def stream(base_url: str, route: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{base_url}/{route}", timeout=300,
                      json={"model": MODEL, "stream": True, **body}) as reply:
        assert reply.status_code == 200, reply.read()
        header = reply.headers.get("x-pdserve-disagg", "")
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert not any("error" in c for c in chunks), chunks
    return chunks, header


FALLBACKS = "pdserve:prefill_fallbacks_total"


def both(pd: Server, vllm: str, route: str, body: dict[str, Any], path: str
         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """pdserve's answer (which took ``path``: a remote one was prefilled remotely, not
    after a failed prefill) and vLLM's, to the same request (sent to both at once)."""
    fallbacks = pd.metric(FALLBACKS)
    with ThreadPoolExecutor(1) as pool:
        theirs = pool.submit(post, vllm, route, body)
        ours, header = post(pd.base_url, route, body)
        assert header.startswith(path), header
        assert pd.metric(FALLBACKS) == fallbacks, pd.log_lines("refused", "prefill of")
        return ours, theirs.result()[0]


def assert_logprobs_close(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    """Chat logprob entries: the same tokens and candidates, values within tolerance."""
    assert [e["token"] for e in ours] == [e["token"] for e in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=LOGPROB_TOLERANCE)
        assert a["bytes"] == b["bytes"]
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
            assert x["logprob"] == pytest.approx(y["logprob"], abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("path", PATHS)
def test_penalties_and_logit_bias_change_the_text_as_on_one_engine(
        pd_server: Server, vllm_openai: str, path: str) -> None:
    base = {"prompt": prompt_for(path), "max_tokens": 32, "temperature": 0,
            "return_token_ids": True}
    plain, _ = post(pd_server.base_url, "completions", base)
    first = plain["choices"][0]["token_ids"][0]
    penalized = {**base, "presence_penalty": 1.5, "frequency_penalty": 1.0,
                 "repetition_penalty": 1.2, "logit_bias": {str(first): -100}, "min_tokens": 8}
    ours, theirs = both(pd_server, vllm_openai, "completions", penalized, path)
    assert ours["choices"][0]["text"] == theirs["choices"][0]["text"]
    assert ours["choices"][0]["token_ids"] == theirs["choices"][0]["token_ids"]
    assert ours["choices"][0]["text"] != plain["choices"][0]["text"]
    assert ours["choices"][0]["token_ids"][0] != first  # the bias held on prefill too


@pytest.mark.parametrize("path", PATHS)
def test_chat_logprobs_match_one_engine_streamed_or_not(
        pd_server: Server, vllm_openai: str, path: str) -> None:
    body = {"messages": chat(path), "max_tokens": 12, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}
    ours, theirs = both(pd_server, vllm_openai, "chat/completions", body, path)
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    assert_logprobs_close(ours["choices"][0]["logprobs"]["content"],
                          theirs["choices"][0]["logprobs"]["content"])
    chunks, header = stream(pd_server.base_url, "chat/completions", body)
    assert header.startswith(path)
    streamed = [e for c in chunks for ch in c["choices"]
                for e in ((ch.get("logprobs") or {}).get("content") or [])]
    assert_logprobs_close(streamed, theirs["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("path", PATHS)
def test_stop_strings_end_the_text_where_one_engine_does(
        pd_server: Server, vllm_openai: str, path: str) -> None:
    """The engines do not detokenize (the router owns text): a stop string taken from the
    middle of one engine's greedy answer ends pdserve's answer where it ends that
    engine's, streamed or not, with the logprobs of the tokens before it."""
    base = {"messages": chat(path), "max_tokens": 24, "temperature": 0}
    full = post(vllm_openai, "chat/completions", base)[0]["choices"][0]["message"]["content"]
    words = full.split()
    assert len(words) >= 4, full
    body = {**base, "stop": [words[len(words) // 2]], "logprobs": True, "top_logprobs": 1}
    ours, theirs = both(pd_server, vllm_openai, "chat/completions", body, path)
    a, b = ours["choices"][0], theirs["choices"][0]
    assert a["message"]["content"] == b["message"]["content"]
    assert a["finish_reason"] == b["finish_reason"] == "stop"
    assert len(a["message"]["content"]) < len(full)
    assert_logprobs_close(a["logprobs"]["content"], b["logprobs"]["content"])
    chunks, header = stream(pd_server.base_url, "chat/completions", body)
    assert header.startswith(path)
    assert "".join(ch["delta"].get("content") or "" for c in chunks
                   for ch in c["choices"]) == b["message"]["content"]


@pytest.mark.parametrize("path", PATHS)
def test_echo_returns_the_prompt_logprobs_of_one_engine(
        pd_server: Server, vllm_openai: str, path: str) -> None:
    body = {"prompt": prompt_for(path), "max_tokens": 4, "temperature": 0, "logprobs": 2,
            "echo": True}
    ours, theirs = both(pd_server, vllm_openai, "completions", body, path)
    a, b = ours["choices"][0], theirs["choices"][0]
    assert a["text"] == b["text"] and a["text"].startswith(prompt_for(path))
    assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
    assert a["logprobs"]["text_offset"] == b["logprobs"]["text_offset"]
    assert a["logprobs"]["token_logprobs"][0] is None
    for x, y in zip(a["logprobs"]["token_logprobs"][1:], b["logprobs"]["token_logprobs"][1:],
                    strict=True):
        assert x == pytest.approx(y, abs=LOGPROB_TOLERANCE)
    for x, y in zip(a["logprobs"]["top_logprobs"][1:], b["logprobs"]["top_logprobs"][1:],
                    strict=True):
        assert x.keys() == y.keys()
        assert all(x[k] == pytest.approx(y[k], abs=LOGPROB_TOLERANCE) for k in x)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}}},
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"regex": "(yes|no), because [a-z ]{5,40}\\."}},
    {"structured_outputs": {"choice": ["north", "south", "east", "west"]}},
], ids=["json_schema", "json_object", "regex", "choice"])
def test_structured_outputs_hold_across_the_handoff(
        pd_server: Server, vllm_openai: str, path: str, constraint: dict[str, Any]) -> None:
    body = {"messages": chat(path, "Answer about a person. "), "max_tokens": 48,
            "temperature": 0, **constraint}
    ours, theirs = both(pd_server, vllm_openai, "chat/completions", body, path)
    text = ours["choices"][0]["message"]["content"]
    assert text == theirs["choices"][0]["message"]["content"]
    if "json_schema" in json.dumps(constraint) and ours["choices"][0]["finish_reason"] == "stop":
        jsonschema.validate(json.loads(text), PERSON)


def tool_calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []]


def streamed_tool_calls(chunks: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for delta in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
                function = delta.get("function") or {}
                call["name"] += function.get("name") or ""
                call["arguments"] += function.get("arguments") or ""
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required", "auto"],
    ids=["named", "required", "auto"])
def test_tool_calls_match_one_engine_streamed_or_not(
        pd_server: Server, vllm_openai: str, path: str, tool_choice: Any) -> None:
    body = {"messages": chat(path, "What is the weather in Paris? "), "max_tokens": 64,
            "temperature": 0, "tools": [WEATHER, TIME], "tool_choice": tool_choice}
    ours, theirs = both(pd_server, vllm_openai, "chat/completions", body, path)
    a, b = ours["choices"][0], theirs["choices"][0]
    assert tool_calls(a["message"]) == tool_calls(b["message"])
    assert a["message"]["content"] == b["message"]["content"]
    assert a["finish_reason"] == b["finish_reason"]
    if tool_choice != "auto":
        assert tool_calls(a["message"]), a  # a forced choice always calls
    chunks, _ = stream(pd_server.base_url, "chat/completions", body)
    assert streamed_tool_calls(chunks) == tool_calls(b["message"])
    assert chunks[-1]["choices"][0]["finish_reason"] == b["finish_reason"]


@pytest.mark.parametrize("path", PATHS)
def test_n_choices_share_one_prefill_and_match_one_engine(
        pd_server: Server, vllm_openai: str, path: str) -> None:
    body = {"prompt": prompt_for(path), "max_tokens": 12, "temperature": 0.8, "seed": 7,
            "n": 3, "return_token_ids": True}
    ours, theirs = both(pd_server, vllm_openai, "completions", body, path)
    mine = sorted(ours["choices"], key=lambda c: c["index"])
    other = sorted(theirs["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in mine] == [0, 1, 2]
    assert ours["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in mine)
    # Choices 1 and 2 run on the decode worker holding choice 0's prompt KV, seeded
    # seed+1 and seed+2 as vLLM seeds its children: the same samples.
    assert [c["text"] for c in mine[1:]] == [c["text"] for c in other[1:]]
    # Choice 0 after a handoff: its first token is prefill's (seeded), the rest decode's.
    assert mine[0]["token_ids"][0] == other[0]["token_ids"][0]
    if path == "local":
        assert mine[0]["text"] == other[0]["text"]
    chunks, _ = stream(pd_server.base_url, "completions", body)
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1, 2}


class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.mark.parametrize("path", PATHS)
def test_the_openai_clients_tools_and_parse_calls_work(pd_server: Server, path: str) -> None:
    client = openai.OpenAI(base_url=pd_server.base_url, api_key="unused")
    messages = cast(list[ChatCompletionMessageParam], chat(path, "What is the weather in Paris? "))
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[cast(ChatCompletionFunctionToolParam, WEATHER)],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64, temperature=0)
    call = reply.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    json.loads(call.function.arguments)  # type: ignore[union-attr]  # JSON (hermes: any)
    parsed = client.beta.chat.completions.parse(
        model=MODEL, messages=chat(path, "Describe a person. "),  # type: ignore[arg-type]
        response_format=Person, max_tokens=256, temperature=0)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person)


@pytest.mark.parametrize("path", PATHS)
def test_a_grammar_the_engine_refuses_is_a_400_and_no_worker_is_blamed(
        pd_server: Server, path: str) -> None:
    fallbacks = pd_server.metric(FALLBACKS)
    reply = httpx.post(f"{pd_server.base_url}/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt_for(path), "max_tokens": 8,
        "structured_outputs": {"grammar": "root ::= ( \"a\""}})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert pd_server.metric(FALLBACKS) == fallbacks
    assert all(w["healthy"] for role in ("prefill", "decode") for w in pd_server.workers(role))


# Texts no other test sends: no worker's cache holds them unsalted before this test.
MEDIUM = " ".join(f"Note {i}: the lantern by the harbor glows." for i in range(16))
SALTED_LONG = " ".join(f"Entry {i}: the quarry road bends west at dusk." for i in range(50))


@pytest.mark.parametrize("path", PATHS)
def test_a_cache_salt_shares_cached_tokens_with_its_own_salt_only(
        pd_server: Server, path: str) -> None:
    """A 204-token prompt (local: one full block) or a longer one (remote): the
    cached tokens a request is told of, and the engine's prefix hit behind them, come only
    from requests under the same salt, unsalted ones included."""
    text = (MEDIUM if path == "local" else SALTED_LONG) + f"\n\nSalted {path}."

    def cached(salt: str | None) -> tuple[int, str]:
        body: dict[str, Any] = {"prompt": text, "max_tokens": 2, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        reply, header = post(pd_server.base_url, "completions", body)
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"], header

    _, header = cached(None)
    assert header.startswith(path), header
    assert cached("tenant-a")[0] == 0
    assert cached("tenant-a")[0] >= 128
    assert cached("tenant-b") == (0, header)  # same path, nothing of a's or of no salt's
    assert cached(None)[0] >= 128
