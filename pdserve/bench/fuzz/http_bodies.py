"""Raw request bodies for the router's OpenAI endpoints (``/v1/chat/completions``,
``/v1/completions``), seeded: bytes that are not JSON, valid bodies cut short, sent
under the wrong content type, with numbers past every limit or not finite, nested
past any parser's depth, fields of the wrong type, strings that are not UTF-8; and
valid ones among them (served while the others are refused).

``is_openai_error`` is the oracle for what comes back: every refusal is OpenAI's
error JSON (``{"error": {"message", "type", "param", "code"}}``), never a 5xx.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from pdserve.bench.fuzz.kv_mutate import ODD_VALUES, RAW_NUMBERS

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CLASSES = ("not_json", "truncated", "content_type", "huge_number", "deep", "wrong_type",
           "bad_utf8", "shape", "valid")
_RAW = "\u0000raw\u0000"
_CONTENT_TYPES = (None, "text/plain", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x", "application/xml", "application/json-x",
                  "application/json; charset=utf-16", "*/*")


@dataclass(frozen=True)
class RawBody:
    """One request: ``path``, ``content`` and its ``content_type`` (None: no header)."""

    cls: str
    path: str
    content: bytes
    content_type: str | None = "application/json"


def valid_body(rng: random.Random, path: str, model: str) -> dict[str, Any]:
    """A small valid request of ``path`` with a few optional fields drawn."""
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(1, 4)}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    for key, values in (("stream", (True, False)), ("temperature", (0, 0.7)),
                        ("n", (1, 2)), ("stop", (["\n"], "x")), ("seed", (1, 2**31)),
                        ("logprobs", (True, 2) if path == CHAT else (1, 2))):
        if rng.random() < 0.3:
            body[key] = rng.choice(values)
    if path == CHAT and body.get("logprobs") == 2:
        body["logprobs"], body["top_logprobs"] = True, 2
    return body


def make(rng: random.Random, cls: str, path: str, model: str) -> RawBody:
    body = valid_body(rng, path, model)
    text = json.dumps(body).encode()
    if cls == "valid":
        return RawBody(cls, path, text)
    if cls == "not_json":
        return RawBody(cls, path, rng.choice((b"", b"{", b"}", b"nul", b"{'model': 1}",
                                              b"\x00" * 8, rng.randbytes(64), b"[" + text)))
    if cls == "truncated":
        return RawBody(cls, path, text[:rng.choice((1, len(text) // 2, len(text) - 1))])
    if cls == "content_type":
        content = rng.choice((text, b"model=x&prompt=hi", text.decode().encode("utf-16")))
        return RawBody(cls, path, content, rng.choice(_CONTENT_TYPES))
    if cls == "deep":
        return RawBody(cls, path, _deep(rng, body))
    if cls == "bad_utf8":
        bad = rng.choice((b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"))
        return RawBody(cls, path, text.replace(b'"hi"', b'"h' + bad + b'i"'))
    if cls == "shape":  # a valid JSON value that is not a request object
        return RawBody(cls, path, json.dumps(rng.choice(([body], "x", 7, None, [], {}))).encode())
    key = rng.choice([k for k in body if k != "model"] + ["model", "max_tokens", "n",
                                                           "temperature", "top_p", "seed"])
    if cls == "huge_number":
        body[key] = _RAW
        return RawBody(cls, path, json.dumps(body).encode().replace(
            json.dumps(_RAW).encode(), rng.choice(RAW_NUMBERS + (b"1e308", b"-0", b"1e-400",
                                                                 b"18446744073709551616"))))
    body[key] = rng.choice(ODD_VALUES)  # wrong_type
    return RawBody(cls, path, json.dumps(body).encode())


def _deep(rng: random.Random, body: dict[str, Any]) -> bytes:
    depth = rng.choice((64, 500, 1000, 5000, 100_000))
    opener, closer = rng.choice(((b"[", b"]"), (b'{"a":', b"}")))
    nested = opener * depth + b"1" + closer * depth
    if rng.random() < 0.5:
        return nested
    key = "messages" if "messages" in body else "prompt"
    body[key] = _RAW
    return json.dumps(body).encode().replace(json.dumps(_RAW).encode(), nested)


def bodies(rng: random.Random, model: str, num_per_path: int) -> list[RawBody]:
    """``num_per_path`` bodies for each endpoint, the classes in turn."""
    return [make(rng, CLASSES[i % len(CLASSES)], path, model)
            for path in (CHAT, COMPLETIONS) for i in range(num_per_path)]


def is_openai_error(body: Any) -> bool:
    """``body`` (parsed JSON) is OpenAI's error object."""
    error = body.get("error") if isinstance(body, dict) else None
    return (isinstance(error, dict) and isinstance(error.get("message"), str)
            and isinstance(error.get("type"), str) and "param" in error and "code" in error)
