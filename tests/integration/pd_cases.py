"""The requests the P/D end-to-end tests send (``test_pd_e2e*.py``), and how they
send them: the official openai client, greedy, returning text and token ids (or raw
HTTP, where the response's headers are checked)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import openai
from pdserve_testing import sse_events, token_ids

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 128
NUM_LAYERS = 30  # SmolLM2-135M
# The tcp cluster's --local-prefill-max-tokens: CASES' short prompts (<= 40 tokens)
# run on decode alone, the two LONG ones (~720 tokens) go prefill -> decode.
LOCAL_PREFILL_MAX_TOKENS = 256
LONG = " ".join(f"Fact {i}: the river by the old mill runs north in spring." for i in range(45))


@dataclass(frozen=True)
class Case:
    kind: str  # "completion" | "chat"
    prompt: Any
    stream: bool
    max_tokens: int


CASES = [
    Case("completion", "The capital of France is", False, 24),
    Case("completion", "Once upon a time, in a small village by the sea,", True, 32),
    Case("completion", LONG + "\nQuestion: which way does the river run?\nAnswer:", True, 24),
    Case("chat", [{"role": "user", "content": "What is 2+2? Answer briefly."}], False, 24),
    Case("chat", [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Name three colors."}], True, 32),
    Case("chat", [{"role": "user", "content": LONG + " Which way does the river run?"}], False, 24),
    Case("completion", "def fibonacci(n):", False, 40),
]


def prompt_ids(tokenizer: Any, case: Case) -> list[int]:
    if case.kind == "chat":
        text = tokenizer.apply_chat_template(case.prompt, add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(case.prompt, add_special_tokens=True)


# Sent only to the cluster whose prefill engine is killed mid-transfer.
# One output position's top candidates in the reference engine: token id -> logprob.
TopLogprobs = dict[int, float]
# bf16 (the correctness oracle: fp32 is token-exact): decode recomputes t1 with another kernel and
# batch, so a greedy choice between two candidates this close (nats, in the reference)
# may flip; everything before the flip must be equal.
BF16_TIE_NATS = 0.5


def near_tie_divergence(got: list[int], want: list[int], tops: list[TopLogprobs],
                        tie_nats: float = BF16_TIE_NATS) -> str | None:
    """None when ``got`` equals ``want`` up to a first difference that the reference
    itself scored as a near-tie (``got``'s token in its top candidates, within
    ``tie_nats`` of its own pick); else what is wrong. After a flip the contexts differ,
    so nothing later can be compared."""
    i = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if i is None:
        return None if len(got) == len(want) else (
            f"same tokens, but {len(got)} of them where the reference has {len(want)}")
    top = tops[i]
    if got[i] not in top:
        return f"position {i}: token {got[i]} is not among the reference's {sorted(top)}"
    gap = top[want[i]] - top[got[i]]
    if gap > tie_nats:
        return f"position {i}: token {got[i]} scored {gap:.3f} nats below {want[i]}"
    return None


KILL_CASE = Case("completion", "Recount every fact. " + LONG * 3 + "\nSummary:", False, 16)


def run_case(client: openai.OpenAI, case: Case) -> tuple[str, list[int]]:
    common: dict[str, Any] = dict(model=MODEL, max_tokens=case.max_tokens, temperature=0,
                                  extra_body={"return_token_ids": True})
    if case.kind == "chat":
        if not case.stream:
            resp = client.chat.completions.create(messages=case.prompt, **common)
            return resp.choices[0].message.content or "", resp.model_dump()["choices"][0][
                "token_ids"]
        text = ""
        ids: list[int] = []
        for chunk in client.chat.completions.create(messages=case.prompt, stream=True, **common):
            for choice in chunk.model_dump()["choices"]:
                text += choice["delta"].get("content") or ""
                ids += choice.get("token_ids") or []
        return text, ids
    if not case.stream:
        resp = client.completions.create(prompt=case.prompt, **common)
        return resp.choices[0].text, resp.model_dump()["choices"][0]["token_ids"]
    text, ids = "", []
    for chunk in client.completions.create(prompt=case.prompt, stream=True, **common):
        for choice in chunk.model_dump()["choices"]:
            text += choice.get("text") or ""
            ids += choice.get("token_ids") or []
    return text, ids


@dataclass(frozen=True)
class Reply:
    token_ids: list[int]
    disagg: str  # the x-pdserve-disagg header: "<local|remote>; reason=<rule>"
    usage: dict[str, Any]


def post_case(base_url: str, case: Case) -> Reply:
    """``case`` over raw HTTP (the openai client hides headers), with its usage."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": case.max_tokens, "temperature": 0,
                            "return_token_ids": True, "stream": case.stream}
    body["messages" if case.kind == "chat" else "prompt"] = case.prompt
    path = "/chat/completions" if case.kind == "chat" else "/completions"
    if not case.stream:
        resp = httpx.post(base_url + path, json=body, timeout=120)
        resp.raise_for_status()
        data = resp.json()
        return Reply(data["choices"][0]["token_ids"], resp.headers["x-pdserve-disagg"],
                     data["usage"])
    body["stream_options"] = {"include_usage": True}
    ids: list[int] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", base_url + path, json=body, timeout=120) as resp:
        resp.raise_for_status()
        for chunk in sse_events(resp.iter_lines()):
            usage = chunk.get("usage") or usage
            ids += token_ids(chunk)
        return Reply(ids, resp.headers["x-pdserve-disagg"], usage)
