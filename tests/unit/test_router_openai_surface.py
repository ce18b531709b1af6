"""The OpenAI surface on the router, over a scripted dispatcher: what each request
feature sends to the workers (``SamplingSpec``), and how ``n`` choices, logprobs and
``echo`` are answered. The same features against real engines, compared with one
``vllm serve``, are in ``tests/integration/test_openai_surface.py``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from unit.fakes import (
    CHAT_COMPLETIONS as CHAT,
)
from unit.fakes import (
    COMPLETIONS,
    FakeDispatcher,
    asgi_http_client,
    chat_body,
    cmpl_body,
    make_router_app,
)

from pdserve.core.types import StructuredOutput
from pdserve.router.dispatch.base import RequestRejectedError

OUTPUT = [28120, 905, 314, 253]


async def post(tokenizer: Any, fake: FakeDispatcher, path: str, body: dict[str, Any]
               ) -> dict[str, Any]:
    async with asgi_http_client(make_router_app(tokenizer, fake)) as http:
        reply = await http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


async def events(tokenizer: Any, fake: FakeDispatcher, path: str, body: dict[str, Any]
                 ) -> list[dict[str, Any]]:
    async with asgi_http_client(make_router_app(tokenizer, fake)) as http:
        reply = await http.post(path, json={**body, "stream": True})
    lines = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def test_sampling_parameters_reach_the_workers(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=OUTPUT)
    await post(tokenizer, fake, COMPLETIONS, cmpl_body(
        presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.1, min_tokens=2,
        min_p=0.05, bad_words=[], spaces_between_special_tokens=True,
        max_tokens=4, logit_bias={"42": 3.5, "7": -200}, stop_token_ids=[5, 5, 9], seed=-1))
    s = fake.calls[0].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.25, 1.1)
    assert s.min_tokens == 2 and s.stop_token_ids == (5, 9) and s.seed is None
    assert s.min_p == 0.05
    assert s.logit_bias == ((42, 3.5), (7, -100.0))  # clamped as vLLM clamps it


@pytest.mark.parametrize(("fields", "expected"), [
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object"}}}},
     StructuredOutput("json", '{"type": "object"}')),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "[ab]+"}}, StructuredOutput("regex", "[ab]+")),
    ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutput("choice", '["x", "y"]')),
    ({"structured_outputs": {"grammar": "root ::= \"a\""}},
     StructuredOutput("grammar", 'root ::= "a"')),
])
async def test_the_grammar_asked_for_reaches_the_workers(
        tokenizer: Any, fields: dict[str, Any], expected: StructuredOutput | None) -> None:
    for path, body in ((COMPLETIONS, cmpl_body(**fields)), (CHAT, chat_body(**fields))):
        fake = FakeDispatcher(output_ids=OUTPUT)
        await post(tokenizer, fake, path, body)
        assert fake.calls[0].sampling.structured == expected


async def test_n_choices_run_as_seeded_siblings_on_the_first_ones_decode(tokenizer: Any
                                                                       ) -> None:
    fake = FakeDispatcher(output_ids=OUTPUT, decode_worker_id="decode-7")
    reply = await post(tokenizer, fake, COMPLETIONS, cmpl_body(n=3, seed=10, max_tokens=4))
    calls = sorted(fake.calls, key=lambda c: c.request_id)
    assert [c.request_id.rsplit("-", 1)[1] for c in calls] == ["0", "1", "2"]
    assert [c.sampling.seed for c in calls] == [10, 11, 12]
    assert [c.affinity for c in calls] == [None, "decode-7", "decode-7"]
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert reply["usage"]["completion_tokens"] == 3 * len(OUTPUT)
    assert sorted(fake.completed) == sorted(c.request_id for c in calls)


async def test_n_choices_stream_each_with_its_index_and_its_own_end(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=OUTPUT, decode_worker_id="d")
    chunks = await events(tokenizer, fake, CHAT, chat_body(
        n=2, stream_options={"include_usage": True}))
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    for index in (0, 1):
        mine = [c for c in choices if c["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["stop"]
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * len(OUTPUT)


async def test_a_stop_string_ends_its_own_choice_only(tokenizer: Any) -> None:
    text = tokenizer.decode(OUTPUT[:2])
    fake = FakeDispatcher(output_ids=OUTPUT, decode_worker_id="d")
    reply = await post(tokenizer, fake, COMPLETIONS, cmpl_body(
        n=2, max_tokens=4, stop=[text.strip()[:3]]))
    assert all(c["finish_reason"] == "stop" for c in reply["choices"])
    assert len(fake.aborted) + len(fake.completed) == 2


async def test_chat_logprobs_are_vllms_shape(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=OUTPUT, logprobs=True)
    reply = await post(tokenizer, fake, CHAT, chat_body(logprobs=True, top_logprobs=2))
    content = reply["choices"][0]["logprobs"]["content"]
    assert fake.calls[0].sampling.logprobs == 2
    assert [e["token"] for e in content] == [tokenizer.decode([t]) for t in OUTPUT]
    first = content[0]
    assert first["logprob"] == -0.75
    assert first["bytes"] == list(first["token"].encode())
    # vLLM's first k candidates, the sampled token first (not sorted by logprob).
    assert [t["logprob"] for t in first["top_logprobs"]] == [-0.75, -0.5]
    streamed = await events(tokenizer, fake, CHAT, chat_body(logprobs=True, top_logprobs=3))
    entries = [e for c in streamed for ch in c["choices"]
               for e in (ch.get("logprobs") or {}).get("content") or []]
    assert [e["top_logprobs"][2]["logprob"] for e in entries] == [-9999.0] * len(OUTPUT)


async def test_echo_puts_the_prompt_and_its_logprobs_first(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=OUTPUT, logprobs=True)
    reply = await post(tokenizer, fake, COMPLETIONS, cmpl_body(
        prompt="The river", echo=True, logprobs=1, max_tokens=4))
    choice = reply["choices"][0]
    prompt_ids = list(fake.calls[0].prompt_token_ids)
    assert fake.calls[0].sampling.prompt_logprobs == 1
    assert choice["text"] == "The river" + tokenizer.decode(OUTPUT)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids) + len(OUTPUT)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert len(logprobs["top_logprobs"][1]) == 2  # the token and the top-1
    offsets = logprobs["text_offset"]
    assert offsets == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(offsets))]


async def test_the_stop_token_that_ends_an_output_counts_but_is_not_text(tokenizer: Any
                                                                        ) -> None:
    """As in vLLM: the end of sequence (even with skip_special_tokens false), or a
    stop_token_ids token, is in the token ids and the usage, not in the text."""
    fake = FakeDispatcher(output_ids=OUTPUT, end_token=2)
    reply = await post(tokenizer, fake, CHAT, chat_body(skip_special_tokens=False,
                                                        return_token_ids=True))
    choice = reply["choices"][0]
    assert choice["message"]["content"] == tokenizer.decode(OUTPUT)
    assert choice["token_ids"] == [*OUTPUT, 2]
    assert reply["usage"]["completion_tokens"] == len(OUTPUT) + 1
    fake = FakeDispatcher(output_ids=OUTPUT)
    reply = await post(tokenizer, fake, COMPLETIONS, cmpl_body(stop_token_ids=[OUTPUT[-1]]))
    assert reply["choices"][0]["text"] == tokenizer.decode(OUTPUT[:-1])


async def test_every_choice_echoes_the_prompt_whose_logprobs_the_first_computed(
        tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=OUTPUT, logprobs=True, decode_worker_id="d")
    body = cmpl_body(prompt="The river", echo=True, logprobs=0, max_tokens=4, n=2)
    reply = await post(tokenizer, fake, COMPLETIONS, body)
    calls = sorted(fake.calls, key=lambda c: c.request_id)
    assert [c.sampling.prompt_logprobs for c in calls] == [0, None]
    first, second = (c["logprobs"] for c in reply["choices"])
    assert first == second and first["token_logprobs"][0] is None
    streamed = await events(tokenizer, fake, COMPLETIONS, body)
    openings: dict[int, dict[str, Any]] = {}
    for chunk in streamed:
        for choice in chunk["choices"]:
            openings.setdefault(choice["index"], choice)
    assert all(c["text"].startswith("The river") for c in openings.values())
    assert all(c["logprobs"]["token_logprobs"][0] is None for c in openings.values())


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_the_engine_refuses_is_a_400_not_a_worker_fault(
        tokenizer: Any, stream: bool) -> None:
    fake = FakeDispatcher(output_ids=OUTPUT,
                          error_before_first=RequestRejectedError("grammar: bad rule"))
    async with asgi_http_client(make_router_app(tokenizer, fake)) as http:
        reply = await http.post(COMPLETIONS, json=cmpl_body(
            stream=stream, structured_outputs={"grammar": "root ::= ("}))
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["message"] == "grammar: bad rule"
