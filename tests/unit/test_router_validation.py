"""Bad inputs get OpenAI error JSON with the right status, and do not reach the workers."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from unit.fakes import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    ROUTER_MAX_MODEL_LEN,
    ROUTER_MODEL,
    FakeDispatcher,
    asgi_http_client,
    chat_body,
    cmpl_body,
    make_router_app,
)

C, CHAT = COMPLETIONS, CHAT_COMPLETIONS  # short names keep the table readable


BAD_INPUTS = [
    # id, method, path, body (dict, or raw bytes), status, expected error.param / error.code
    ("malformed_json", "POST", C, b'{"model": ', 400, {"param": None}),
    ("body_not_object", "POST", C, b"[1, 2]", 400, {"param": None}),
    ("missing_model", "POST", C, {"prompt": "hi"}, 400, {"param": "model"}),
    ("unknown_model", "POST", C, cmpl_body(model="gpt-4"), 404, {"code": "model_not_found"}),
    ("unknown_model_chat", "POST", CHAT, chat_body(model="x"), 404, {"code": "model_not_found"}),
    ("missing_prompt", "POST", C, {"model": ROUTER_MODEL}, 400, {"param": "prompt"}),
    ("missing_messages", "POST", CHAT, {"model": ROUTER_MODEL}, 400, {"param": "messages"}),
    ("empty_messages", "POST", CHAT, chat_body(messages=[]), 400, {"param": "messages"}),
    (
        "bad_role",
        "POST",
        CHAT,
        chat_body(messages=[{"role": "wizard", "content": "hi"}]),
        400,
        {"param": "messages"},
    ),
    (
        "image_content_part",
        "POST",
        CHAT,
        chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        {"param": "messages"},
    ),
    ("n_2_greedy", "POST", C, cmpl_body(n=2, temperature=0), 400, {"param": "n"}),
    ("n_2_greedy_chat", "POST", CHAT, chat_body(n=2, temperature=0), 400, {"param": "n"}),
    ("n_0", "POST", C, cmpl_body(n=0), 400, {"param": "n"}),
    ("best_of", "POST", C, cmpl_body(best_of=2), 400, {"param": "best_of"}),
    ("min_p_2", "POST", C, cmpl_body(min_p=2), 400, {"param": "min_p"}),
    ("beam_search", "POST", C, cmpl_body(use_beam_search=True), 400,
     {"param": "use_beam_search"}),
    ("bad_words", "POST", CHAT, chat_body(bad_words=["x"]), 400, {"param": "bad_words"}),
    ("guided_json", "POST", CHAT, chat_body(guided_json={"type": "object"}), 400,
     {"param": "guided_json"}),
    ("prompt_logprobs", "POST", C, cmpl_body(prompt_logprobs=1), 400,
     {"param": "prompt_logprobs"}),
    ("temperature_negative", "POST", C, cmpl_body(temperature=-1), 400, {"param": "temperature"}),
    ("temperature_3", "POST", CHAT, chat_body(temperature=3), 400, {"param": "temperature"}),
    ("temperature_hot", "POST", C, cmpl_body(temperature="hot"), 400, {"param": "temperature"}),
    ("top_p_0", "POST", C, cmpl_body(top_p=0), 400, {"param": "top_p"}),
    ("top_k_minus_2", "POST", C, cmpl_body(top_k=-2), 400, {"param": "top_k"}),
    ("cache_salt_empty", "POST", C, cmpl_body(cache_salt=""), 400, {"param": "cache_salt"}),
    ("cache_salt_slash", "POST", CHAT, chat_body(cache_salt="a/b"), 400,
     {"param": "cache_salt"}),
    ("cache_salt_long", "POST", C, cmpl_body(cache_salt="x" * 129), 400,
     {"param": "cache_salt"}),
    ("cache_salt_number", "POST", CHAT, chat_body(cache_salt=7), 400, {"param": "cache_salt"}),
    ("max_tokens_0", "POST", C, cmpl_body(max_tokens=0), 400, {"param": "max_tokens"}),
    ("max_tokens_negative", "POST", C, cmpl_body(max_tokens=-5), 400, {"param": "max_tokens"}),
    ("max_tokens_string", "POST", C, cmpl_body(max_tokens="many"), 400, {"param": "max_tokens"}),
    (
        "max_tokens_over_context",
        "POST",
        C,
        cmpl_body(max_tokens=ROUTER_MAX_MODEL_LEN),
        400,
        {"code": "context_length_exceeded"},
    ),
    (
        "max_completion_tokens_over_context",
        "POST",
        CHAT,
        chat_body(max_completion_tokens=10_000),
        400,
        {"code": "context_length_exceeded"},
    ),
    (
        "prompt_too_long",
        "POST",
        C,
        cmpl_body(prompt="hello " * ROUTER_MAX_MODEL_LEN),
        400,
        {"code": "context_length_exceeded"},
    ),
    (
        "chat_prompt_too_long",
        "POST",
        CHAT,
        chat_body(messages=[{"role": "user", "content": "hello " * ROUTER_MAX_MODEL_LEN}]),
        400,
        {"code": "context_length_exceeded"},
    ),
    ("empty_prompt", "POST", C, cmpl_body(prompt=""), 400, {"param": "prompt"}),
    ("empty_token_prompt", "POST", C, cmpl_body(prompt=[]), 400, {"param": "prompt"}),
    ("two_prompts", "POST", C, cmpl_body(prompt=["a", "b"]), 400, {"param": "prompt"}),
    ("token_id_out_of_vocab", "POST", C, cmpl_body(prompt=[1, 10**6]), 400, {"param": "prompt"}),
    ("token_id_negative", "POST", C, cmpl_body(prompt=[-1]), 400, {"param": "prompt"}),
    (
        "stream_options_without_stream",
        "POST",
        C,
        cmpl_body(stream_options={"include_usage": True}),
        400,
        {"param": "stream_options"},
    ),
    ("top_logprobs_alone", "POST", CHAT, chat_body(top_logprobs=2), 400,
     {"param": "top_logprobs"}),
    ("top_logprobs_21", "POST", CHAT, chat_body(logprobs=True, top_logprobs=21), 400,
     {"param": "top_logprobs"}),
    ("logprobs_completions_21", "POST", C, cmpl_body(logprobs=21), 400, {"param": "logprobs"}),
    ("presence_penalty_3", "POST", C, cmpl_body(presence_penalty=3), 400,
     {"param": "presence_penalty"}),
    ("frequency_penalty_low", "POST", CHAT, chat_body(frequency_penalty=-2.5), 400,
     {"param": "frequency_penalty"}),
    ("repetition_penalty_0", "POST", C, cmpl_body(repetition_penalty=0), 400,
     {"param": "repetition_penalty"}),
    ("logit_bias_key", "POST", C, cmpl_body(logit_bias={"abc": 1}), 400,
     {"param": "logit_bias"}),
    ("logit_bias_out_of_vocab", "POST", C, cmpl_body(logit_bias={"1000000": 1}), 400,
     {"param": "logit_bias"}),
    # Past int()'s 4,300-digit limit: a 400 naming the field, not a 500.
    ("logit_bias_key_4400_digits", "POST", C, cmpl_body(logit_bias={"9" * 4400: 1}), 400,
     {"param": "logit_bias"}),
    ("logit_bias_key_4400_digits_chat", "POST", CHAT,
     chat_body(logit_bias={"1" * 4400: 1}), 400, {"param": "logit_bias"}),
    ("logit_bias_key_past_uint32", "POST", C, cmpl_body(logit_bias={str(2**32): 1}), 400,
     {"param": "logit_bias"}),
    ("logit_bias_key_arabic_digit", "POST", C, cmpl_body(logit_bias={"\u0663": 1}), 400,
     {"param": "logit_bias"}),
    ("int_4400_digits", "POST", C, b'{"model": "m", "prompt": "hi", "max_tokens": '
     + b"9" * 4400 + b"}", 400, {"param": None}),
    ("stop_token_ids_out_of_vocab", "POST", C, cmpl_body(stop_token_ids=[10**6]), 400,
     {"param": "stop_token_ids"}),
    ("min_tokens_over_max", "POST", C, cmpl_body(min_tokens=9, max_tokens=2), 400,
     {"param": "min_tokens"}),
    ("echo_chat", "POST", CHAT, chat_body(echo=True), 400, {"param": "echo"}),
    ("tools_malformed", "POST", CHAT, chat_body(tools=[{"type": "function"}]), 400,
     {"param": "tools"}),
    ("tools_empty", "POST", CHAT, chat_body(tools=[]), 400, {"param": "tools"}),
    ("tool_choice_without_tools", "POST", CHAT, chat_body(tool_choice="required"), 400,
     {"param": "tools"}),
    ("tool_choice_unknown_name", "POST", CHAT,
     chat_body(tools=[{"type": "function", "function": {"name": "f"}}],
               tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     {"param": "tool_choice"}),
    ("tool_choice_auto_without_parser", "POST", CHAT,
     chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     {"param": "tool_choice"}),
    ("json_schema_without_schema", "POST", C,
     cmpl_body(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400,
     {"param": "response_format"}),
    ("response_format_unknown", "POST", C, cmpl_body(response_format={"type": "yaml"}), 400,
     {"param": "response_format"}),
    ("structured_outputs_two", "POST", C,
     cmpl_body(structured_outputs={"regex": "a+", "choice": ["a"]}), 400,
     {"param": "structured_outputs"}),
    ("structured_outputs_empty_grammar", "POST", C, cmpl_body(structured_outputs={"grammar": ""}),
     400, {"param": "structured_outputs"}),
    ("structured_outputs_bad_regex", "POST", C, cmpl_body(structured_outputs={"regex": "("}),
     400, {"param": "structured_outputs"}),
    (
        "five_stop_strings",
        "POST",
        C,
        cmpl_body(stop=["a", "b", "c", "d", "e"]),
        400,
        {"param": "stop"},
    ),
    ("empty_stop_string", "POST", C, cmpl_body(stop=[""]), 400, {"param": "stop"}),
    ("unknown_route", "POST", "/v1/nothing", cmpl_body(), 404, {"param": None}),
    ("get_completions", "GET", C, None, 405, {"param": None}),
]


@pytest.fixture(scope="module")
def table_dispatcher() -> FakeDispatcher:
    return FakeDispatcher(output_ids=[28120])


@pytest.fixture(scope="module")
def table_app(tokenizer: Any, table_dispatcher: FakeDispatcher) -> FastAPI:
    return make_router_app(tokenizer, table_dispatcher)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "expected"),
    [pytest.param(*row[1:], id=row[0]) for row in BAD_INPUTS],
)
async def test_bad_input_is_rejected_with_openai_error(
    table_app: FastAPI,
    method: str,
    path: str,
    body: dict[str, Any] | bytes | None,
    status: int,
    expected: dict[str, str | None],
) -> None:
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    if isinstance(body, bytes):
        kwargs["headers"] = {"content-type": "application/json"}
    async with asgi_http_client(table_app) as client:
        response = await client.request(method, path, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == "invalid_request_error"
    for key, value in expected.items():
        assert error[key] == value, error


async def test_server_keeps_serving_after_bad_inputs(
    table_app: FastAPI, table_dispatcher: FakeDispatcher
) -> None:
    for _, method, path, body, _, _ in BAD_INPUTS:
        async with asgi_http_client(table_app) as client:
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
            await client.request(method, path, **kwargs)
    assert table_dispatcher.calls == []  # no bad input reached the workers
    async with asgi_http_client(table_app) as client:
        response = await client.post(C, json=cmpl_body(max_tokens=4))
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == "hello"


async def test_context_error_message_gives_the_lengths(table_app: FastAPI) -> None:
    async with asgi_http_client(table_app) as client:
        response = await client.post(
            C, json=cmpl_body(prompt=[1, 2, 3], max_tokens=ROUTER_MAX_MODEL_LEN)
        )
    message = response.json()["error"]["message"]
    assert f"maximum context length is {ROUTER_MAX_MODEL_LEN}" in message
    assert f"3 in the prompt, {ROUTER_MAX_MODEL_LEN} for the completion" in message
