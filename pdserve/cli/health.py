"""``pdserve health``: one probe of a router or a worker, for container health checks.

A single command serves every container of the image (Docker's ``HEALTHCHECK`` is
per image); the target says what to ask:

- ``http://HOST:PORT/PATH``: GET; healthy on 200 (the router's ``/health``, which is
  200 only while a decode worker is servable);
- ``grpc://HOST:PORT``: the standard ``grpc.health.v1`` ``Check`` of the whole server;
  healthy on SERVING (a worker says so once its engine is ready, NOT_SERVING while
  it loads or drains). The health service is open without the cluster secret; a
  worker that serves TLS is asked over TLS with ``--tls-cert``/``--tls-key``/``--tls-ca``
  (its certificate must name the host dialled: 127.0.0.1 in a pod's own probe).

Every probe has a deadline; a refused, late or unhealthy answer is "unhealthy".
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from pdserve.core.grpc_tls import GrpcTls

DEFAULT_TARGET = "http://127.0.0.1:8000/health"
SCHEMES = ("http", "grpc")


@dataclass(frozen=True)
class HealthTarget:
    scheme: str  # one of SCHEMES
    host: str
    port: int
    path: str = "/"  # http only

    @classmethod
    def parse(cls, text: str) -> HealthTarget:
        """``http://host:port/path`` or ``grpc://host:port``; anything else is a ValueError."""
        parts = urlsplit(text.strip())
        if parts.scheme not in SCHEMES:
            raise ValueError(f"health target {text!r}: expected http://HOST:PORT/PATH or "
                             "grpc://HOST:PORT")
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise ValueError(f"health target {text!r}: expected {parts.scheme}://HOST:PORT")
        if parts.scheme == "grpc" and parts.path not in ("", "/"):
            raise ValueError(f"health target {text!r}: expected grpc://HOST:PORT, no path")
        return cls(parts.scheme, parts.hostname, port, parts.path or "/")

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class HealthResult:
    healthy: bool
    detail: str  # what answered, or why nothing healthy did


def probe(target: HealthTarget, timeout_s: float, tls: GrpcTls | None = None) -> HealthResult:
    """Ask ``target`` once, within ``timeout_s``; a gRPC target over TLS with ``tls``."""
    if target.scheme == "grpc":
        return _probe_grpc(target, timeout_s, tls)
    return _probe_http(target, timeout_s)


def _probe_http(target: HealthTarget, timeout_s: float) -> HealthResult:
    import httpx

    url = f"http://{target.authority}{target.path}"
    try:
        response = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return HealthResult(False, f"GET {url}: {type(exc).__name__}: {exc}")
    return HealthResult(response.status_code == 200, f"GET {url}: {response.status_code}")


def _probe_grpc(target: HealthTarget, timeout_s: float, tls: GrpcTls | None) -> HealthResult:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = (grpc.insecure_channel(target.authority) if tls is None
               else grpc.secure_channel(target.authority, tls.channel_credentials()))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(  # type: ignore[attr-defined]  # the stubs' HealthStub lists no methods
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as exc:
            return HealthResult(False, f"grpc health {target.authority}: {exc.code().name}")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return HealthResult(reply.status == health_pb2.HealthCheckResponse.SERVING,
                        f"grpc health {target.authority}: {status}")
