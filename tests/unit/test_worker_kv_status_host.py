"""A worker reads its connector's counters from its own KV endpoint: where that endpoint
listens. Found on hosts: a worker started with ``--host 10.77.4.2`` asked loopback, where
nothing listens, and reported its first (empty) KV counters for ever."""

from __future__ import annotations

import pytest

from pdserve.worker.vllm.kv_status import kv_status_host


@pytest.mark.parametrize(("bind", "advertised", "tls", "want"), [
    ("0.0.0.0", "10.0.0.7", False, "127.0.0.1"),  # every address: loopback answers
    ("", "10.0.0.7", False, "127.0.0.1"),
    ("::", "10.0.0.7", False, "::1"),
    ("10.77.4.2", "10.77.4.2", False, "10.77.4.2"),  # one address: only it answers
    ("127.0.0.1", "127.0.0.1", False, "127.0.0.1"),
    ("0.0.0.0", "worker-3.svc", True, "worker-3.svc"),  # TLS: the name its certificate has
])
def test_the_worker_asks_its_kv_endpoint_where_it_listens(bind: str, advertised: str,
                                                          tls: bool, want: str) -> None:
    assert kv_status_host(bind, advertised, tls) == want
