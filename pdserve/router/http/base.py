"""The HTTP edge's contracts: what it asks of a tokenizer, and how every failure
reaches a client.

The edge (``app.py``, ``serving.py`` and the request/response modules beside them)
validates OpenAI requests, tokenizes once, hands token ids to a ``Dispatcher``
(``pdserve.router.dispatch.base``) and renders its chunks as OpenAI responses. It owns
nothing on the workers: closing a dispatcher's generator is how it gives a request up.
Every error it raises is an ``APIError``: the one exception type that carries its HTTP
status and its OpenAI error body (``errors.py`` maps everything else to one).
"""

from __future__ import annotations

from typing import Any, Protocol


class TokenDecoder(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class APIError(Exception):
    """An error with its OpenAI rendering; subclasses fix status and type."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }
