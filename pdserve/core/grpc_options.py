"""gRPC options for both ends of every router↔worker channel, kept in one place so the
two ends agree.

Keepalive: the router pings each worker every ``keepalive_s`` (with or without calls in
flight) and closes the connection when a ping is not answered within ``keepalive_s``;
every call on it then fails with UNAVAILABLE. A hung worker (SIGSTOP, a wedged event
loop, a dropped network) is so noticed within about twice ``keepalive_s``, not at its
requests' deadlines (minutes). The worker pings the router the same way, so a hung
router's calls are cancelled on the worker, which aborts them and frees their KV.

A gRPC server sends GOAWAY ("too_many_pings") to a client that pings more often than it
allows; the worker allows one every ``MIN_KEEPALIVE_S / 2``, which is why no end may
be configured below ``MIN_KEEPALIVE_S``.
"""

from __future__ import annotations

DEFAULT_KEEPALIVE_S = 2.0
MIN_KEEPALIVE_S = 1.0
MAX_MESSAGE_BYTES = 64 << 20

Options = list[tuple[str, int]]


def _keepalive(keepalive_s: float) -> Options:
    if keepalive_s < MIN_KEEPALIVE_S:
        raise ValueError(f"gRPC keepalive must be >= {MIN_KEEPALIVE_S:g} s, not {keepalive_s}")
    ms = int(keepalive_s * 1000)
    return [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms),
            # Measured with grpcio 1.85: keepalive_timeout alone never closes the
            # connection to a stopped peer (its calls ran to their deadlines); the
            # ping timeout is what gives up on an unanswered ping.
            ("grpc.http2.ping_timeout_ms", ms),
            ("grpc.keepalive_permit_without_calls", 1)]


def client_options(keepalive_s: float = DEFAULT_KEEPALIVE_S) -> Options:
    """A router's channel to a worker."""
    return [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            *_keepalive(keepalive_s),
            # Without this a client stops pinging after two pings with no data sent,
            # and an idle stream (a decode waiting on its KV) would go unwatched.
            ("grpc.http2.max_pings_without_data", 0)]


def server_options(keepalive_s: float = DEFAULT_KEEPALIVE_S) -> Options:
    """A worker's gRPC server."""
    return [("grpc.so_reuseport", 0),
            *_keepalive(keepalive_s),
            ("grpc.http2.min_recv_ping_interval_without_data_ms",
             int(MIN_KEEPALIVE_S * 1000) // 2),
            ("grpc.http2.max_pings_without_data", 0),
            # A worker whose cores are saturated (an engine loading beside it) reads
            # two of the router's pings late and back to back; gRPC counts that as a
            # strike and, at the default two, sends GOAWAY: every call on the channel
            # fails UNAVAILABLE "Too many pings" (seen under the KV pool's fault test).
            # The router is this cluster's own, authenticated client: no strikes.
            ("grpc.http2.max_ping_strikes", 0)]
