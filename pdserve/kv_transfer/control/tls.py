"""Mutual TLS on KV control connections (``--tls-cert``, ``--tls-key``, ``--tls-ca``).

Every KV connection starts on the control channel (``channel.py``), so TLS there
covers everything the tcp transport sends: its KV bytes travel on that connection.
ucx and torch.distributed negotiate on it but move KV on their own paths, which
stay unencrypted: ``--require-tls`` refuses them (``config.py``).

Both ends prove themselves: the server requires a client certificate the CA
signed, and the client checks that the server's certificate names the address it
dialled (the worker's advertised KV host, e.g. an IP SAN), as gRPC's TLS does.
TLS 1.2 at least; TLS 1.3 where both ends have it (OpenSSL picks AES-GCM, with
the CPU's AES instructions when it has them). No session tickets: connections
are pooled and long-lived, and an idle one must have nothing to read (``pool.dropped``).

The cluster secret's challenge (``auth.py``), when there is one, runs inside TLS.
"""

from __future__ import annotations

import functools
import logging
import socket
import ssl
from dataclasses import dataclass

from pdserve.core.grpc_tls import TlsFiles
from pdserve.kv_transfer.control.wire import TransferError, set_deadline

logger = logging.getLogger("pdserve.kv_transfer.tls")


class TlsHandshakeError(TransferError):
    """The TLS handshake failed: no certificate, one the CA did not sign, a wrong name."""


@dataclass(frozen=True, eq=False)
class KvTls:
    """A server and a client context made from the same files (``load_kv_tls``)."""

    server: ssl.SSLContext
    client: ssl.SSLContext

    def accept(self, conn: socket.socket, deadline: float) -> ssl.SSLSocket:
        """The server's end of a fresh connection, once the client proved its certificate."""
        return _handshake(self.server.wrap_socket(conn, server_side=True,
                                                  do_handshake_on_connect=False), deadline)

    def connect(self, conn: socket.socket, host: str, deadline: float) -> ssl.SSLSocket:
        """The client's end, once the server's certificate proved it is ``host``."""
        return _handshake(self.client.wrap_socket(conn, server_hostname=host,
                                                  do_handshake_on_connect=False), deadline)


def load_kv_tls(files: TlsFiles) -> KvTls | None:
    """The contexts, or None for plaintext KV: without TLS files, or without all three
    (KV peers are both servers and clients, so KV TLS is mutual; gRPC TLS alone, e.g.
    ``--tls-cert``/``--tls-key`` on a worker, keeps working as before, and the process
    says once that its KV stays plaintext; ``--require-tls`` needs all three files).
    ``ValueError`` for a file that does not load."""
    if not files.enabled:
        return None
    if not files.mutual:
        _warn_plaintext_kv()
        return None
    return _load(files)


@functools.cache
def _warn_plaintext_kv() -> None:
    logger.warning("KV connections stay plaintext: TLS on them is mutual and needs "
                   "--tls-cert, --tls-key and --tls-ca (gRPC uses the files given)")


@functools.lru_cache(maxsize=4)
def _load(files: TlsFiles) -> KvTls:
    server = files.ssl_context(server=True)
    server.num_tickets = 0
    return KvTls(server, files.ssl_context(server=False))


def _handshake(conn: ssl.SSLSocket, deadline: float) -> ssl.SSLSocket:
    try:
        set_deadline(conn, deadline)
        conn.do_handshake()
    except ssl.SSLError as exc:
        conn.close()
        why = getattr(exc, "verify_message", None) or exc.reason or str(exc)
        raise TlsHandshakeError(f"TLS handshake failed: {why}") from None
    except (OSError, TransferError) as exc:
        conn.close()
        raise TlsHandshakeError(f"TLS handshake did not complete: {exc}") from None
    return conn
