"""The router's OpenAI endpoints through the official ``openai`` client and raw HTTP: shapes,
streaming, stop strings, dispatcher failures, and the operational endpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import pytest
from unit.fakes import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    ROUTER_MAX_MODEL_LEN,
    ROUTER_MODEL,
    USER_MESSAGES,
    FakeDispatcher,
    asgi_http_client,
    asgi_openai_client,
    chat_body,
    cmpl_body,
    make_router_app,
    sse_payloads,
)

from pdserve.router.dispatch.base import NoWorkerAvailableError

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

ANSWER = " Paris is the capital of France. It is known for the Eiffel Tower."
MULTIBYTE = " 你好，世界！🙂 Emoji 👍🏽 and 日本語のテキスト."
# fakes' USER_MESSAGES, as the OpenAI client types a chat's messages
MESSAGES = cast("list[ChatCompletionMessageParam]", USER_MESSAGES)


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# --- happy paths through the openai client ---------------------------------------------


async def test_completion_non_streaming(tokenizer: Any) -> None:
    answer_ids = ids_of(tokenizer, ANSWER)
    fake = FakeDispatcher(output_ids=answer_ids, num_cached_tokens=3)
    prompt = "The capital of France is"
    async with asgi_openai_client(make_router_app(tokenizer, fake)) as client:
        result = await client.completions.create(
            model=ROUTER_MODEL,
            prompt=prompt,
            max_tokens=40,
            temperature=0.5,
            top_p=0.9,
            seed=7,
            extra_body={"top_k": -1, "ignore_eos": True},
        )
    assert result.object == "text_completion"
    assert result.id.startswith("cmpl-")
    assert result.choices[0].text == ANSWER
    assert result.choices[0].finish_reason == "stop"
    call = fake.calls[0]
    assert list(call.prompt_token_ids) == tokenizer.encode(prompt, add_special_tokens=True)
    spec = call.sampling
    assert (spec.max_tokens, spec.temperature, spec.top_p, spec.top_k) == (40, 0.5, 0.9, 0)
    assert (spec.seed, spec.ignore_eos) == (7, True)
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(call.prompt_token_ids)
    assert result.usage.completion_tokens == len(answer_ids)
    assert result.usage.total_tokens == len(call.prompt_token_ids) + len(answer_ids)
    assert result.usage.prompt_tokens_details is not None
    assert result.usage.prompt_tokens_details.cached_tokens == 3
    assert fake.completed == [call.request_id] and fake.aborted == []


async def test_completion_defaults_and_finish_reason_length(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=ids_of(tokenizer, ANSWER * 3))
    async with asgi_openai_client(make_router_app(tokenizer, fake)) as client:
        result = await client.completions.create(model=ROUTER_MODEL, prompt=[504, 3575, 282])
    spec = fake.calls[0].sampling
    assert (spec.max_tokens, spec.temperature, spec.top_p, spec.top_k) == (16, 1.0, 1.0, 0)
    assert fake.calls[0].prompt_token_ids == (504, 3575, 282)
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 16


async def test_chat_non_streaming_applies_template(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=ids_of(tokenizer, MULTIBYTE), tokens_per_chunk=3)
    messages: list[Any] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Say hi"}]},
    ]
    async with asgi_openai_client(make_router_app(tokenizer, fake)) as client:
        result = await client.chat.completions.create(model=ROUTER_MODEL, messages=messages)
    flat = [messages[0], {"role": "user", "content": "Say hi"}]
    text = tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    call = fake.calls[0]
    assert list(call.prompt_token_ids) == prompt_ids
    assert call.sampling.max_tokens == ROUTER_MAX_MODEL_LEN - len(prompt_ids)
    # The workers' id: the response's, and 128 random bits.
    assert call.request_id.startswith(f"{result.id}.") and result.id.startswith("chatcmpl-")
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == MULTIBYTE
    assert result.choices[0].finish_reason == "stop"


async def test_chat_max_completion_tokens_wins(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=ids_of(tokenizer, ANSWER))
    async with asgi_openai_client(make_router_app(tokenizer, fake)) as client:
        result = await client.chat.completions.create(
            model=ROUTER_MODEL, messages=MESSAGES, max_tokens=50, max_completion_tokens=4
        )
    assert fake.calls[0].sampling.max_tokens == 4
    assert result.choices[0].finish_reason == "length"
    assert result.choices[0].message.content == tokenizer.decode(ids_of(tokenizer, ANSWER)[:4])


async def test_chat_streaming_with_usage(tokenizer: Any) -> None:
    answer_ids = ids_of(tokenizer, MULTIBYTE)
    fake = FakeDispatcher(output_ids=answer_ids, num_cached_tokens=2)
    async with asgi_openai_client(make_router_app(tokenizer, fake)) as client:
        stream = await client.chat.completions.create(
            model=ROUTER_MODEL,
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    body = chunks[1:-2]
    assert all(c.choices[0].finish_reason is None for c in body)
    assert "".join(c.choices[0].delta.content or "" for c in body) == MULTIBYTE
    finish = chunks[-2].choices[0]
    assert finish.finish_reason == "stop" and finish.delta.content is None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(answer_ids)
    assert chunks[-1].usage.prompt_tokens_details is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 2
    assert {f"{c.id}." for c in chunks} == {fake.calls[0].request_id[:-32]}


async def test_completion_streaming(tokenizer: Any) -> None:
    answer_ids = ids_of(tokenizer, MULTIBYTE)
    fake = FakeDispatcher(output_ids=answer_ids, tokens_per_chunk=2)
    async with asgi_openai_client(make_router_app(tokenizer, fake)) as client:
        stream = await client.completions.create(model=ROUTER_MODEL, prompt="Hi", stream=True)
        chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(answer_ids[:16])
    assert [c.choices[0].finish_reason for c in chunks][-2:] == [None, "length"]
    assert all(c.usage is None and c.object == "text_completion" for c in chunks)


async def test_streaming_raw_sse_format(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=ids_of(tokenizer, ANSWER))
    body = chat_body(stream=True, stream_options={"include_usage": True})
    async with asgi_http_client(make_router_app(tokenizer, fake)) as client:
        response = await client.post(CHAT_COMPLETIONS, json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-3]["choices"][0]["delta"] == {}
    assert all(p["usage"] is None for p in payloads[:-2])
    assert payloads[-2]["choices"] == [] and payloads[-2]["usage"]["total_tokens"] > 0


async def test_return_token_ids(tokenizer: Any) -> None:
    answer_ids = ids_of(tokenizer, ANSWER)
    fake = FakeDispatcher(output_ids=answer_ids)
    extra = {"return_token_ids": True}
    async with asgi_openai_client(make_router_app(tokenizer, fake)) as client:
        result = await client.completions.create(model=ROUTER_MODEL, prompt="Hi", extra_body=extra)
        stream = await client.chat.completions.create(
            model=ROUTER_MODEL, messages=MESSAGES, stream=True, extra_body=extra
        )
        chunks = [chunk.model_dump() async for chunk in stream]
    assert result.model_dump()["prompt_token_ids"] == list(fake.calls[0].prompt_token_ids)
    assert result.choices[0].model_dump()["token_ids"] == answer_ids[:16]
    assert chunks[0]["prompt_token_ids"] == list(fake.calls[1].prompt_token_ids)
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert streamed == answer_ids


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_spanning_tokens(tokenizer: Any, stream: bool) -> None:
    answer_ids = ids_of(tokenizer, ANSWER)
    fake = FakeDispatcher(output_ids=answer_ids, delay_s=0.001)
    # " of Fr" starts inside the token " of" and ends inside " France".
    stop = ["never matches", " of Fr"]
    async with asgi_openai_client(make_router_app(tokenizer, fake)) as client:
        if stream:
            chunks = await client.completions.create(
                model=ROUTER_MODEL, prompt="Hi", max_tokens=50, stop=stop, stream=True
            )
            parts = [(c.choices[0].text, c.choices[0].finish_reason) async for c in chunks]
            text, finish = "".join(p[0] for p in parts), parts[-1][1]
        else:
            result = await client.completions.create(
                model=ROUTER_MODEL, prompt="Hi", max_tokens=50, stop=stop
            )
            text, finish = result.choices[0].text, result.choices[0].finish_reason
    assert text == " Paris is the capital"
    assert finish == "stop"
    assert fake.aborted == [fake.calls[0].request_id]  # stopped early: the workers abort


async def test_stop_prefix_that_never_completes_is_released(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=ids_of(tokenizer, ANSWER))
    async with asgi_openai_client(make_router_app(tokenizer, fake)) as client:
        stream = await client.chat.completions.create(
            model=ROUTER_MODEL, messages=MESSAGES, stop=" Tower!", stream=True, max_tokens=100
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == ANSWER
    assert fake.aborted == []


# --- dispatcher failures ---------------------------------------------------------------


@pytest.mark.parametrize("path,body", [(COMPLETIONS, cmpl_body()), (CHAT_COMPLETIONS, chat_body())])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("when", ["error_on_call", "error_before_first"])
async def test_no_worker_available_is_503(
    tokenizer: Any, path: str, body: dict[str, Any], stream: bool, when: str
) -> None:
    failure: dict[str, Any] = {when: NoWorkerAvailableError("all workers down")}
    fake = FakeDispatcher(**failure)
    async with asgi_http_client(make_router_app(tokenizer, fake)) as client:
        response = await client.post(path, json={**body, "stream": stream})
    assert response.status_code == 503
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "no_worker_available")


async def test_worker_failure_before_first_chunk_is_500_when_streaming(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=[1, 2], fail_after_chunks=0)
    async with asgi_http_client(make_router_app(tokenizer, fake)) as client:
        response = await client.post(COMPLETIONS, json=cmpl_body(stream=True))
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"


async def test_worker_failure_mid_stream_sends_error_event(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=ids_of(tokenizer, ANSWER), fail_after_chunks=3)
    async with asgi_http_client(make_router_app(tokenizer, fake)) as client:
        response = await client.post(CHAT_COMPLETIONS, json=chat_body(stream=True))
        non_streaming = await client.post(CHAT_COMPLETIONS, json=chat_body())
    assert response.status_code == 200
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["error"]["type"] == "server_error"
    assert "choices" in payloads[-3]
    assert non_streaming.status_code == 500
    assert non_streaming.json()["error"]["type"] == "server_error"


@pytest.mark.parametrize("reason", ["error", "abort"])
async def test_error_finish_reason_is_500(tokenizer: Any, reason: str) -> None:
    fake = FakeDispatcher(output_ids=[28120, 28120], finish_reason=reason)  # type: ignore[arg-type]
    async with asgi_http_client(make_router_app(tokenizer, fake)) as client:
        response = await client.post(COMPLETIONS, json=cmpl_body())
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"


# --- models, health, metrics -----------------------------------------------------------


async def test_models(tokenizer: Any) -> None:
    async with asgi_openai_client(make_router_app(tokenizer, FakeDispatcher())) as client:
        models = [m async for m in client.models.list()]
    assert [m.id for m in models] == [ROUTER_MODEL]
    assert models[0].owned_by == "pdserve"
    assert models[0].model_dump()["max_model_len"] == ROUTER_MAX_MODEL_LEN


async def test_health(tokenizer: Any) -> None:
    fake = FakeDispatcher()
    async with asgi_http_client(make_router_app(tokenizer, fake)) as client:
        ready = await client.get("/health")
        fake.ready = False
        not_ready = await client.get("/health")
    assert (ready.status_code, ready.json()) == (200, {"status": "ok"})
    assert not_ready.status_code == 503
    assert not_ready.json()["error"]["type"] == "service_unavailable"


async def test_metrics_count_requests_and_tokens(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=[28120, 905, 30])
    async with asgi_http_client(make_router_app(tokenizer, fake)) as client:
        await client.post(COMPLETIONS, json=cmpl_body(prompt=[1, 2, 3, 4]))
        await client.post(COMPLETIONS, json=cmpl_body(prompt=[1, 2], stream=True))
        await client.post(COMPLETIONS, json=cmpl_body(model="nope"))
        text = (await client.get("/metrics")).text
    assert 'pdserve:http_requests_total{endpoint="/v1/completions",status_code="200"} 2.0' in text
    assert 'pdserve:http_requests_total{endpoint="/v1/completions",status_code="404"} 1.0' in text
    assert f'pdserve:prompt_tokens_total{{model_name="{ROUTER_MODEL}"}} 6.0' in text
    assert f'pdserve:generation_tokens_total{{model_name="{ROUTER_MODEL}"}} 6.0' in text
    assert f'pdserve:time_to_first_token_seconds_count{{model_name="{ROUTER_MODEL}"}} 2.0' in text
    assert f'pdserve:e2e_request_latency_seconds_count{{model_name="{ROUTER_MODEL}"}} 2.0' in text
    assert f'pdserve:inter_token_latency_seconds_count{{model_name="{ROUTER_MODEL}"}} 4.0' in text
    assert "pdserve:requests_in_flight 0.0" in text
    assert ('pdserve:request_success_total{finished_reason="stop",'
            f'model_name="{ROUTER_MODEL}"}} 2.0') in text
