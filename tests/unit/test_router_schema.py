"""Schema-driven property tests: Schemathesis generates requests from the router's own
``/openapi.json`` (valid and invalid ones) and calls the app in process (ASGI) on a fake
dispatcher. Every response must be no 5xx and conform to the schema (status documented,
content type, body shape); afterwards the router still serves a normal request.

Budget: ``MAX_EXAMPLES`` per operation, no Hypothesis database, derandomized, so a run
takes seconds and is the same every time.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance
from starlette.testclient import TestClient
from unit.fakes import COMPLETIONS, FakeDispatcher, cmpl_body, default_tokenizer, make_router_app

MAX_EXAMPLES = 25

APP = make_router_app(default_tokenizer(), FakeDispatcher(output_ids=list(range(100, 140))))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)

# positive_data_acceptance expects a 2xx for every body the schema allows. The schema
# cannot say what the router checks against the model it serves: the served model's
# name, a prompt that is not empty after tokenization, prompt + max_tokens within
# max_model_len, token ids within the vocabulary. Those are documented 400/404s.
_EXCLUDED = [positive_data_acceptance]


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_every_response_conforms_and_none_is_5xx(case: schemathesis.Case) -> None:
    response = case.call_and_validate(excluded_checks=_EXCLUDED)
    assert response.status_code < 500, response.text


def test_still_serves_a_normal_request_afterwards() -> None:
    with TestClient(APP) as client:
        reply = client.post(COMPLETIONS, json=cmpl_body(max_tokens=4))
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] == "length"
    assert (APP.state.admission.num_running, APP.state.admission.num_waiting) == (0, 0)


def test_the_schema_documents_no_422() -> None:
    """Invalid input gets OpenAI's 400 (documented), never FastAPI's 422: the schema
    names none (``RouterApp.openapi``), also when asked again."""
    for _ in range(2):
        spec = APP.openapi()
        statuses = {status for item in spec["paths"].values() for operation in item.values()
                    for status in operation["responses"]}
        assert "400" in statuses and "422" not in statuses
        assert "HTTPValidationError" not in spec["components"]["schemas"]
