"""``pdserve bench compare --vllm-url``: the baseline is a vLLM OpenAI server that is
already running (on another machine, or one its operator started with flags of their
own). Compare neither starts nor stops it; it checks, before any system starts, that the
URL answers ``/v1/models`` within the startup timeout and serves the model compare's
runs ask for, and keeps what ``/v1/models`` says of that model for the report.

Its engine settings (dtype, KV cache, max-model-len, batch cap, cores) are the
operator's: compare cannot see them, so it cannot vouch they match the other systems'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from pdserve.core import process

# What a model card of /v1/models may say that the report keeps (vLLM: max_model_len,
# root = the model path it loaded, owned_by).
CARD_FIELDS = ("id", "root", "max_model_len", "owned_by")


@dataclass(frozen=True)
class ExternalVllm:
    """A running vLLM OpenAI server: its base URL (no ``/v1``) and what its
    ``/v1/models`` says of the model compare asks for (``CARD_FIELDS``)."""

    url: str
    card: dict[str, Any] = field(default_factory=dict)


def base_url(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1``: ``http://host:8000/v1`` ->
    ``http://host:8000``. ValueError unless it is an http(s) URL with a host."""
    text = url.strip().rstrip("/")
    if text.endswith("/v1"):
        text = text[: -len("/v1")]
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--vllm-url {url!r}: expected http(s)://HOST:PORT (with or "
                         "without /v1)")
    try:
        parts.port  # noqa: B018 - a bad port raises here
    except ValueError as exc:
        raise ValueError(f"--vllm-url {url!r}: {exc}") from None
    return text


def port_of(url: str) -> int:
    """The port ``url`` (``base_url``'s) names, or its scheme's default."""
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def check_external(url: str, served_name: str, timeout_s: float,
                   interval_s: float = 1.0) -> ExternalVllm:
    """Wait up to ``timeout_s`` until ``url``'s ``/v1/models`` answers, then check it
    serves ``served_name``. ValueError (one line, for the CLI) when nothing answers in
    time or the model is not among those it serves."""
    root = base_url(url)
    models: list[dict[str, Any]] = []
    last = "no answer"

    def probe() -> str:
        nonlocal last
        try:
            last = _models(root, models)
        except (httpx.HTTPError, ValueError) as exc:  # nothing listening yet, and why
            last = f"{type(exc).__name__}: {exc}"
        return last

    try:
        process.wait_ready(probe, timeout_s, interval_s=interval_s)
    except process.NotReadyError:
        raise ValueError(f"--vllm-url {root}: /v1/models did not answer within "
                         f"--startup-timeout-s {timeout_s:g} ({last})") from None
    card = next((m for m in models if m.get("id") == served_name), None)
    if card is None:
        served = ", ".join(repr(m.get("id")) for m in models) or "no model"
        raise ValueError(f"--vllm-url {root} serves {served}, not {served_name!r} (the "
                         "served name of --model; start vLLM with --served-model-name "
                         f"{served_name})")
    return ExternalVllm(root, {k: card[k] for k in CARD_FIELDS if k in card})


def _models(root: str, into: list[dict[str, Any]]) -> str:
    """'' once ``/v1/models`` lists models (put ``into``), else what is wrong."""
    reply = httpx.get(f"{root}/v1/models", timeout=5.0)
    if reply.status_code != 200:
        return f"/v1/models: HTTP {reply.status_code}"
    body = reply.json()
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return "/v1/models: no 'data' list"
    into[:] = [m for m in data if isinstance(m, dict)]
    return ""
