"""Cluster control's errors (``router/cluster/errors.py``) reach a client as OpenAI error
JSON with the status of their kind (``router/http/errors.py``), their message, code and
param unchanged: cluster control says whose fault it is, HTTP says it in status codes."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pdserve.router.cluster.errors import (
    ClusterError,
    Conflict,
    Failed,
    Invalid,
    NotFound,
    Unavailable,
)
from pdserve.router.http.errors import install_error_handlers, to_api_error


@pytest.mark.parametrize(("error", "status", "kind"), [
    (NotFound("no worker 'w9'", code="worker_not_found", param="id"), 404,
     "invalid_request_error"),
    (Invalid("not a checkpoint", code="invalid_checkpoint", param="model_path"), 400,
     "invalid_request_error"),
    (Conflict("an update is running", code="weight_update_running"), 409,
     "invalid_request_error"),
    (Unavailable("no worker to update", code="no_workers"), 503, "service_unavailable"),
    (Failed("stage failed on w1", code="weight_call_failed"), 500, "server_error"),
    (ClusterError("of no kind"), 500, "server_error"),
])
def test_each_kind_has_its_status_and_keeps_its_words(error: ClusterError, status: int,
                                                       kind: str) -> None:
    api = to_api_error(error)
    assert (api.status_code, api.error_type) == (status, kind)
    assert (api.message, api.code, api.param) == (error.message, error.code, error.param)


def test_a_route_that_raises_one_answers_openai_error_json() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/admin/workers/{worker_id}/role")
    async def switch(worker_id: str) -> None:
        raise NotFound(f"no worker {worker_id!r} in this router's view", param="id",
                       code="worker_not_found")

    reply = TestClient(app).post("/admin/workers/w9/role")
    assert reply.status_code == 404
    assert reply.json() == {"error": {"message": "no worker 'w9' in this router's view",
                                      "type": "invalid_request_error", "param": "id",
                                      "code": "worker_not_found"}}
