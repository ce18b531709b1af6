"""SSE framing (``router/responses.py``): the cached envelope of later chunks gives the
same bytes as serializing each whole chunk with pydantic. (Two formatters: a formatter
keeps per-choice state from chunk to chunk.)"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.types import SamplingSpec
from pdserve.router.http.openai.preprocess import GenerationRequest
from pdserve.router.http.openai.responses import OutputDelta, formatter_for, sse_event


def request(endpoint: str, include_usage: bool, return_token_ids: bool) -> GenerationRequest:
    return GenerationRequest(
        request_id="cmpl-1", endpoint=endpoint, model='m"\\odel', prompt_token_ids=(1, 2),  # type: ignore[arg-type]
        sampling=SamplingSpec(4), stop=(), stream=True, include_usage=include_usage,
        return_token_ids=return_token_ids, created=1_700_000_000, arrival_s=0.0)


@pytest.mark.parametrize(("endpoint", "include_usage", "return_token_ids"),
                         list(itertools.product(("completions", "chat"), (False, True),
                                                (False, True))))
def test_later_chunks_encode_as_pydantic_does(endpoint: str, include_usage: bool,
                                              return_token_ids: bool) -> None:
    formatter = formatter_for(request(endpoint, include_usage, return_token_ids))
    reference = formatter_for(request(endpoint, include_usage, return_token_ids))
    for text, ids, finish, first in [("héllo\n\t\"x\" \x01 ✓", [5, 6], None, True),
                                     (" wörld\\", [7], None, False), ("", [], "length", False),
                                     ("", [8], None, False), ("😀", [9], "stop", False)]:
        delta = OutputDelta(text, ids, finish)
        want = b"".join(sse_event(e) for e in reference.stream_events(delta, first))
        assert formatter.encode_stream(delta, first) == want


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(st.text(max_size=12), min_size=1, max_size=6),
       endpoint=st.sampled_from(("completions", "chat")), include_usage=st.booleans())
def test_the_plain_chunk_fast_path_gives_pydantics_bytes(
        texts: list[str], endpoint: str, include_usage: bool) -> None:
    """Any text (controls, quotes, backslashes, astral characters): the pre-rendered
    frame with orjson's string gives what the whole chunk's pydantic rendering gives."""
    formatter = formatter_for(request(endpoint, include_usage, False))
    reference = formatter_for(request(endpoint, include_usage, False))
    for i, text in enumerate(["opening", *texts]):
        delta = OutputDelta(text, [1], None)
        want = b"".join(sse_event(e) for e in reference.stream_events(delta, i == 0))
        assert formatter.encode_stream(delta, i == 0) == want
