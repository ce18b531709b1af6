"""An encrypted cluster: the shared ``TCP`` cluster runs ``pdserve up --require-tls``
with a test CA's files (``pd_server``; this file sorts before the transports', so it
runs on that cluster, whose greedy-equality tests in ``test_pd_e2e.py`` already ran
over TLS). Here: a remote request's KV came over the TLS KV channel, membership is on
etcd over TLS, and a plaintext client of each is refused: gRPC, KV and etcd."""

from __future__ import annotations

import base64
import ssl

import httpx
import openai
import pytest
from integration.pd_cases import LONG, MODEL
from pdserve_testing import Server, wait_until

from pdserve.kv_transfer.control.dial import request_once
from pdserve.kv_transfer.control.tls import load_kv_tls
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.router.dispatch.workers.client import WorkerCallError, probe_health

pytestmark = pytest.mark.integration


def test_under_require_tls_kv_comes_over_tls_and_plaintext_clients_are_refused(
    pd_server: Server,
) -> None:
    assert pd_server.tls_files is not None, "the TCP cluster runs --require-tls"
    kv_tls = load_kv_tls(pd_server.tls_files)
    (prefill,) = pd_server.workers("prefill")
    health = probe_health(prefill["endpoint"], timeout_s=5, secret=pd_server.secret,
                          tls=pd_server.tls)
    kv_host, kv_port = health.kv_host or "127.0.0.1", health.kv_port

    # A remote request: its KV can only have come over the TLS channel.
    before = pd_server.load("decode")
    client = openai.OpenAI(base_url=pd_server.base_url, api_key="none", timeout=120)
    reply = client.completions.create(model=MODEL, prompt=LONG + "\nWhere is the mill?",
                                      max_tokens=4, temperature=0)
    assert reply.choices[0].text
    after = pd_server.load("decode")
    assert after.kv_loads > before.kv_loads, "the prompt was not prefilled remotely"

    # gRPC: a plaintext call to a worker fails; the same call with the certificate works.
    with pytest.raises(WorkerCallError):
        probe_health(prefill["endpoint"], timeout_s=5, secret=pd_server.secret)

    # KV: plaintext is refused in the handshake, and counted by the endpoint (its
    # ``status`` over TLS says so).
    def refusals() -> int:
        status = request_once(kv_host, kv_port, {"op": "status"}, 5, pd_server.secret, kv_tls)
        return int(status["kv_auth_refusals"])

    refused = refusals()
    with pytest.raises(TransferError):
        request_once(kv_host, kv_port, {"op": "status"}, 5, pd_server.secret)
    assert wait_until(lambda: refusals() == refused + 1, timeout_s=5)



def test_under_require_tls_membership_is_on_etcd_over_tls(pd_server: Server) -> None:
    """up's own etcd (``--with-etcd``) serves https with client certificates only: the
    router found both workers there; the workers' keys read back over TLS with the
    cluster's certificate, while a plaintext client and one without a certificate get
    nothing."""
    assert pd_server.tls_files is not None
    view = httpx.get(pd_server.base_url.removesuffix("/v1") + "/workers", timeout=5).json()
    membership = view["membership"]
    assert (membership["kind"], membership["tls"], membership["connected"]) == ("etcd", True,
                                                                               True)
    url = str(membership["url"])
    assert url.startswith("https://")
    assert {w["role"] for w in view["workers"]} == {"prefill", "decode"}

    files = pd_server.tls_files
    with_cert = ssl.create_default_context(cafile=str(files.ca))
    with_cert.load_cert_chain(str(files.cert), str(files.key))
    found = _range(url, with_cert)
    assert len(found.json()["kvs"]) >= 2  # both workers' registrations
    with pytest.raises(httpx.HTTPError):  # plaintext to the TLS port
        _range(url.replace("https://", "http://"), True)
    with pytest.raises(httpx.HTTPError):  # TLS, but no client certificate
        _range(url, ssl.create_default_context(cafile=str(files.ca)))


def _range(url: str, verify: ssl.SSLContext | bool) -> httpx.Response:
    """Every key under /pdserve/ through etcd's JSON gateway."""
    body = {"key": base64.b64encode(b"/pdserve/").decode(),
            "range_end": base64.b64encode(b"/pdserve0").decode()}
    reply = httpx.post(f"{url}/v3/kv/range", json=body, timeout=5, verify=verify)
    reply.raise_for_status()
    return reply
