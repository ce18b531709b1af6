"""The router's per-call proof and the worker's answer (``pdserve/core/grpc_proofs.py``),
checked as pure functions: audience, method, time window, spent nonces, the bounded
nonce set, malformed headers, and the worker's proof bound to the router's nonce."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from pdserve.core.cluster_secret import ClusterSecret, export_refusals, note_refusal
from pdserve.core.grpc_proofs import (
    WINDOW_S,
    CallVerifier,
    NonceCache,
    check_worker_proof,
    sign_call,
    worker_proof,
)

SECRET = ClusterSecret(b"the-cluster-secret-0123456789")
OTHER = ClusterSecret(b"a-stranger-secret-9876543210")
HEALTH = "/pdserve.v1.WorkerService/Health"
LOAD = "/pdserve.v1.WorkerService/GetLoad"


def test_a_fresh_header_passes_once_and_its_replay_fails() -> None:
    verifier = CallVerifier(SECRET, "d0")
    header, nonce = sign_call(SECRET, "d0", HEALTH)
    assert verifier.check(header, HEALTH) == (None, nonce)
    assert verifier.check(header, HEALTH) == ("replayed nonce", "")


@pytest.mark.parametrize("secret,audience,method,reason", [
    (OTHER, "d0", HEALTH, "wrong token"),   # another secret
    (SECRET, "d1", HEALTH, "wrong token"),  # signed for another worker
    (SECRET, "d0", LOAD, "wrong token"),    # signed for another method
    (SECRET, "", HEALTH, "audience unknown"),  # a router asking whom it talks to
])
def test_a_header_for_another_secret_worker_or_method_fails(
        secret: ClusterSecret, audience: str, method: str, reason: str) -> None:
    header, _ = sign_call(secret, audience, method)
    assert CallVerifier(SECRET, "d0").check(header, HEALTH) == (reason, "")


@pytest.mark.parametrize("skew_s", [-(WINDOW_S + 1), WINDOW_S + 1])
def test_a_header_outside_the_window_fails(skew_s: float) -> None:
    header, _ = sign_call(SECRET, "d0", HEALTH, now_ms=int((time.time() + skew_s) * 1000))
    assert CallVerifier(SECRET, "d0").check(header, HEALTH) == ("stale token", "")
    inside, _ = sign_call(SECRET, "d0", HEALTH,
                          now_ms=int((time.time() + skew_s / 2) * 1000))
    assert CallVerifier(SECRET, "d0").check(inside, HEALTH)[0] is None


@pytest.mark.parametrize("header", [None, "", "v1.1.2.3", "v2.x.00.00", "v2.1.short.00",
                                    "garbage", "v2.1." + "0" * 32 + ".00.extra",
                                    "v2." + "9" * 5000 + "." + "0" * 32 + ".00",
                                    "v2.\u00b2." + "0" * 32 + ".00",  # isdigit, int() raises
                                    "v2.\u0661\u0662." + "0" * 32 + ".00"])
def test_a_malformed_header_fails(header: str | None) -> None:
    reason, nonce = CallVerifier(SECRET, "d0").check(header, HEALTH)
    assert reason in ("no token", "malformed token", "stale token") and nonce == ""


def test_a_full_nonce_set_refuses_rather_than_forgets() -> None:
    cache = NonceCache(capacity=2)
    assert cache.add("a") is None and cache.add("b") is None
    assert cache.add("c") == "nonce cache full"
    assert cache.add("a") == "replayed nonce"  # still remembered


def test_nonces_are_forgotten_only_after_their_header_expired(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    cache = NonceCache(window_s=1.0)
    assert cache.add("a") is None
    now[0] += 1.9  # a header up to 1 s in the future could still pass
    assert cache.add("a") == "replayed nonce"
    now[0] += 0.2
    assert cache.add("a") is None


def test_the_workers_proof_binds_its_id_the_method_and_the_routers_nonce() -> None:
    proof = worker_proof(SECRET, "d0", HEALTH, "n1")
    assert check_worker_proof(SECRET, "d0", HEALTH, "n1", proof)
    assert not check_worker_proof(SECRET, "d0", HEALTH, "n2", proof)  # a recorded answer
    assert not check_worker_proof(SECRET, "d1", HEALTH, "n1", proof)
    assert not check_worker_proof(SECRET, "d0", LOAD, "n1", proof)
    assert not check_worker_proof(SECRET, "d0", HEALTH, "n1", None)
    assert not check_worker_proof(OTHER, "d0", HEALTH, "n1", proof)
    # The router's header is never a worker's proof (the labels differ).
    header, nonce = sign_call(SECRET, "d0", HEALTH)
    assert not check_worker_proof(SECRET, "d0", HEALTH, nonce, header.rsplit(".", 1)[1])


def test_refusals_show_on_a_registry_of_its_own() -> None:
    """The router's /metrics registry shows the process's refusals (``export_refusals``)."""
    registry = CollectorRegistry()
    export_refusals(registry)
    labels = {"plane": "membership", "reason": "entry without MAC"}
    before = registry.get_sample_value("pdserve_cluster_auth_refusals_total", labels) or 0.0
    note_refusal("membership", "entry without MAC", "/pdserve/x/workers/decode/rogue")
    assert registry.get_sample_value("pdserve_cluster_auth_refusals_total",
                                     labels) == before + 1
