"""``X-Session-ID`` (``router/http/openai/sessions.py``): a session's turns stay on the
decode worker of its first turn, while it serves; they fall back to placement when it
is gone. Two fake decode workers under round robin, which would alternate them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from unit.dispatch_cluster import WAIT_S, running_cluster
from unit.fakes import ROUTER_MODEL, asgi_http_client, cmpl_body

from pdserve.router.http.app import create_app
from pdserve.router.http.openai.sessions import SessionAffinity


def decodes_used(c: Any) -> list[int]:
    return [len(d.servicer.generates) for d in c.decodes]


async def test_a_session_stays_on_its_decode_worker_and_falls_back_when_it_is_gone(
        tokenizer: Any) -> None:
    async with running_cluster(num_decode=2) as c:
        app = create_app(served_model_name=ROUTER_MODEL, max_model_len=4096,
                         tokenizer=tokenizer, dispatcher=c.dispatcher, registry=c.registry)
        async with asgi_http_client(app) as http:
            async def turn(session: str | None) -> None:
                headers = {"X-Session-ID": session} if session else {}
                r = await asyncio.wait_for(http.post(
                    "/v1/completions", json=cmpl_body(max_tokens=4), headers=headers), WAIT_S)
                assert r.status_code == 200, r.text

            await turn("s1")
            first = decodes_used(c)
            for _ in range(3):
                await turn("s1")
            after = decodes_used(c)
            (home,) = [i for i, n in enumerate(first) if n]
            assert after[home] == 4 and after[1 - home] == 0  # round robin would alternate
            await turn(None)
            await turn(None)
            assert decodes_used(c)[1 - home] >= 1  # others still spread
            await c.decodes[home].stop()
            await c.pool.refresh_all()
            before = decodes_used(c)[1 - home]
            await turn("s1")  # its worker gone: placement decides, the session follows
            assert decodes_used(c)[1 - home] == before + 1


def test_the_session_table_is_bounded_and_forgets_the_oldest() -> None:
    sessions = SessionAffinity(max_sessions=2)
    sessions.remember("a", "w1")
    sessions.remember("b", "w2")
    assert sessions.worker_of("a") == "w1"  # a is now the most recent
    sessions.remember("c", "w3")
    assert (sessions.worker_of("a"), sessions.worker_of("b"),
            sessions.worker_of("c")) == ("w1", None, "w3")
    sessions.remember("x" * 1000, "w1")  # an id too long to keep
    assert sessions.worker_of("x" * 1000) is None
    with pytest.raises(ValueError):
        SessionAffinity(0)
