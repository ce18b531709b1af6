"""What the router answers when workers refuse a vLLM weight-transfer call
(``cluster/fanout.call_error``, mapped by ``http/errors.to_api_error``): the caller's
mistake (every worker refused the body, or was not started for weight transfer) is a
4xx, anything else a 500."""

from __future__ import annotations

import pytest

from pdserve.router.cluster.fanout import call_error
from pdserve.router.dispatch.workers.client import WorkerCallError
from pdserve.router.http.errors import to_api_error


@pytest.mark.parametrize(("codes", "status", "code"), [
    (("INVALID_ARGUMENT", "INVALID_ARGUMENT"), 400, "weight_call_invalid"),
    (("FAILED_PRECONDITION", "FAILED_PRECONDITION"), 409, "weight_transfer_off"),
    (("FAILED_PRECONDITION", "INVALID_ARGUMENT"), 409, "weight_call_refused"),
    (("FAILED_PRECONDITION", "INTERNAL"), 500, "weight_call_failed"),
    (("UNAVAILABLE",), 500, "weight_call_failed"),
])
def test_refusals_by_every_worker_are_the_callers_mistake(
        codes: tuple[str, ...], status: int, code: str) -> None:
    results: dict[str, object] = {f"w{i}": WorkerCallError(c, "no") for i, c in enumerate(codes)}
    results["ok"] = "v1"  # a worker that took the call does not change the answer
    error = call_error("update_weights", results)
    assert (to_api_error(error).status_code, error.code) == (status, code)
    assert "update_weights failed: worker w0" in error.message


def test_an_exception_that_is_not_a_worker_call_error_is_a_server_error() -> None:
    error = call_error("update_weights", {"w0": RuntimeError("boom")})
    assert (to_api_error(error).status_code, error.code) == (500, "weight_call_failed")
