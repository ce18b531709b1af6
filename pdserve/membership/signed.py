"""Membership entries signed with the cluster secret.

With a cluster secret, a worker writes its registration (``WorkerInfo.to_json()``) with
one more field, ``mac``: ``HMAC(k, "pdserve-membership-v1", key, the info's JSON)``, so the
MAC covers the etcd key (a role and an id) and every byte of the value. The router reads
an entry only if its MAC verifies (constant time); one without a MAC, or with a wrong one,
is ignored, counted and logged (``note_refusal``, plane ``membership``): whoever can
write to etcd but lacks the secret cannot add a worker, nor move or change one. Without a
secret, entries are written and read as before (no ``mac``, none checked).

A signed entry can be copied back after its worker left (etcd keeps no history of who
wrote it, and a client may choose its lease id). Such a stale entry names an endpoint
that must still answer with a proof of the secret for the worker's id
(``pdserve.core.grpc_auth``) before anything is sent to it; that stops a stranger, but not
one who took over the old address and relays the router's calls to the real worker, now
elsewhere, to borrow its proofs (the proof covers the router's nonce, not the
connection). gRPC TLS that checks the worker's host name (``--tls-ca``) closes that.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from pdserve.core.cluster_secret import ClusterSecret
from pdserve.membership.base import WorkerInfo

MAC_FIELD = "mac"
_LABEL = b"pdserve-membership-v1"


def _mac(secret: ClusterSecret, key: str, body: bytes) -> str:
    return secret.mac(_LABEL, key.encode(), body).hex()


def signed_value(secret: ClusterSecret | None, key: str, info: WorkerInfo) -> bytes:
    """What a worker writes at ``key``: the info, with its MAC under a ``secret``."""
    body = info.to_json()
    if secret is None:
        return body
    data = json.loads(body)
    data[MAC_FIELD] = _mac(secret, key, body)
    return json.dumps(data, sort_keys=True).encode()


def unverified(secret: ClusterSecret | None, key: str, raw: bytes) -> str | None:
    """None when the entry may be read (its MAC verifies, or there is no ``secret``);
    else why it may not."""
    if secret is None:
        return None
    try:
        data: Any = json.loads(raw)
    except (ValueError, RecursionError):  # bad JSON or bytes, 4,300+ digits, deep nesting
        return "entry not JSON"
    if not isinstance(data, dict):
        return "entry not an object"
    mac = data.pop(MAC_FIELD, None)
    if not isinstance(mac, str):
        return "entry without MAC"
    body = json.dumps(data, sort_keys=True).encode()
    if not hmac.compare_digest(mac.encode(), _mac(secret, key, body).encode()):
        return "entry MAC wrong"
    return None
