"""Membership entries signed with the cluster secret (``pdserve/membership/signed.py``):
what verifies, what does not, and hostile values that must be refused, never raise."""

from __future__ import annotations

import json

import pytest

from pdserve.core.cluster_secret import ClusterSecret
from pdserve.membership import WorkerInfo, worker_key
from pdserve.membership.signed import signed_value, unverified

SECRET = ClusterSecret(b"the-cluster-secret-0123456789")
OTHER = ClusterSecret(b"a-stranger-secret-9876543210")
INFO = WorkerInfo(worker_id="d0", role="decode", grpc_endpoint="10.0.0.7:50061",
                  kv_endpoints={"tcp": "10.0.0.7:51061"}, capacity={"kv_cache_gib": 1.5})
KEY = worker_key("c", "decode", "d0")


def test_a_signed_entry_verifies_and_still_parses() -> None:
    value = signed_value(SECRET, KEY, INFO)
    assert unverified(SECRET, KEY, value) is None
    assert WorkerInfo.from_json(value) == INFO  # readers ignore the extra field


def test_without_a_secret_nothing_is_signed_or_checked() -> None:
    assert signed_value(None, KEY, INFO) == INFO.to_json()
    assert unverified(None, KEY, INFO.to_json()) is None


def test_what_does_not_verify() -> None:
    assert unverified(SECRET, KEY, INFO.to_json()) == "entry without MAC"
    assert unverified(SECRET, KEY, signed_value(OTHER, KEY, INFO)) == "entry MAC wrong"
    # Moved to another key (another role or id): the MAC names the key.
    other_key = worker_key("c", "prefill", "d0")
    assert unverified(SECRET, other_key, signed_value(SECRET, KEY, INFO)) == "entry MAC wrong"
    # Any field changed after signing.
    data = json.loads(signed_value(SECRET, KEY, INFO))
    data["grpc_endpoint"] = "6.6.6.6:50061"
    assert unverified(SECRET, KEY, json.dumps(data).encode()) == "entry MAC wrong"


@pytest.mark.parametrize("value", [b"not json", b"\xff\xfe", b"[1, 2]", b'"s"',
                                   b'{"a": ' + b"9" * 5000 + b"}",
                                   b"[" * 100_000 + b"]" * 100_000,
                                   b'{"mac": 7}'])
def test_hostile_values_are_refused_not_raised(value: bytes) -> None:
    assert unverified(SECRET, KEY, value) is not None
