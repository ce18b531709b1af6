"""The ``x-weight-version`` header holds whatever version the admin gave (or a folder's
name): a version that is not printable ASCII (found by the socket fuzz: one admin call
made every later response a 500, a header latin-1 cannot encode) is percent-encoded,
through a real uvicorn, streaming or not."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from unit.fakes import ROUTER_MODEL, FakeDispatcher, cmpl_body, serve_in_thread

from pdserve.router.http.app import create_app


@pytest.mark.parametrize("version", ["v1-\U0008d0c4", "权重\r\nX-Evil: 1", "a%20b", "plain-v2"])
@pytest.mark.parametrize("stream", [False, True])
def test_any_weight_version_is_a_header_value(tokenizer: Any, version: str,
                                              stream: bool) -> None:
    fake = FakeDispatcher(output_ids=tokenizer.encode(" one two")[:2], weight_version=version)
    app = create_app(served_model_name=ROUTER_MODEL, max_model_len=256, tokenizer=tokenizer,
                     dispatcher=fake)
    with serve_in_thread(app) as url:
        reply = httpx.post(url + "/v1/completions", json=cmpl_body(max_tokens=2, stream=stream),
                           timeout=10)
    assert reply.status_code == 200, reply.text
    header = reply.headers["x-weight-version"]
    assert header.isascii() and header.isprintable() and "x-evil" not in reply.headers
    assert unquote(header) == version
    assert (header == version) == (version == "plain-v2")
