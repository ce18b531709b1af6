"""The price of a handoff's KV on the path it would take: prefill's KV endpoint to the
decode worker, at the rate the decode worker measured its pulls from that peer at
(``GetLoad``'s ``kv_links``, ``kv_transfer/links.py``).

In pull mode the first token comes from prefill and the transfer then holds the stream
until decode has the KV: a long prompt over a thin link can cost more than computing it
on decode. ``choose_disagg`` weighs that (``--link-aware``): the ``slo`` rule adds it to
the remote route's time to stream, the ``auto`` rules compute the prompt on decode
(``slow_link``) when moving its KV would hold its stream longer than computing it there
holds every stream decode runs (this one and the others: they share its steps). And
``cache_aware`` placement adds each prefill's path to the chosen decode to its cost, so a
prefill behind a faster link takes the long prompts (``placement.path_tokens``).

A path the decode worker has not measured lately (no pull of 1 MiB or more within
``--kv-link-max-age-s``) has no price: the decision is then the one without links, and
the next long prompt's pull measures the path again.
"""

from __future__ import annotations

from pdserve.router.dispatch.workers.state import StepCost, WorkerState


def transfer_s(prefill: WorkerState, decode: WorkerState, num_tokens: int) -> float | None:
    """Seconds to move ``num_tokens`` tokens' KV from ``prefill`` to ``decode`` (None: a
    path not measured)."""
    if num_tokens <= 0:
        return 0.0
    peer = f"{prefill.kv_host}:{prefill.kv_port}"
    for link in decode.load.kv_links:
        if link.peer == peer and link.bytes_per_s > 0:
            return num_tokens * link.bytes_per_token / link.bytes_per_s
    return None


def compute_s(decode: StepCost, num_tokens: int) -> float:
    """What computing ``num_tokens`` prompt tokens adds to decode's steps."""
    return decode.per_token_s * num_tokens
