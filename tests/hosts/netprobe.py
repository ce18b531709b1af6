"""Small socket programs the host tests run inside the hosts (``python netprobe.py ...``).

- ``sink PORT``: a TCP server; each connection's bytes are counted until EOF and the
  count is sent back.
- ``push HOST PORT NBYTES TIMEOUT``: connect, send NBYTES, read the count back; prints
  ``{"bytes": n, "seconds": s}`` or ``{"error": "..."}`` (exit 0 either way).
- ``udp-listen PORT COUNT SECONDS``: prints how many datagrams came, once COUNT have
  or SECONDS have passed.
- ``udp-send HOST PORT COUNT``: COUNT datagrams, 10 ms apart.
"""

from __future__ import annotations

import json
import socket
import sys
import time


def sink(port: int) -> None:
    server = socket.create_server(("0.0.0.0", port), reuse_port=True)
    while True:
        conn, _ = server.accept()
        with conn:
            total = 0
            while chunk := conn.recv(1 << 20):
                total += len(chunk)
            conn.sendall(str(total).encode())


def push(host: str, port: int, nbytes: int, timeout_s: float) -> None:
    started = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            started = time.monotonic()
            conn.sendall(b"x" * nbytes)
            conn.shutdown(socket.SHUT_WR)
            count = int(conn.recv(64))
        print(json.dumps({"bytes": count, "seconds": time.monotonic() - started}))
    except OSError as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}",
                          "seconds": time.monotonic() - started}))


def udp_listen(port: int, want: int, seconds: float) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("0.0.0.0", port))
        deadline = time.monotonic() + seconds
        count = 0
        while count < want and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                sock.recv(2048)
                count += 1
            except TimeoutError:
                break
        print(count)


def udp_send(host: str, port: int, count: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _ in range(count):
            sock.sendto(b"ping", (host, port))
            time.sleep(0.01)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "sink":
        sink(int(args[0]))
    elif mode == "push":
        push(args[0], int(args[1]), int(args[2]), float(args[3]))
    elif mode == "udp-listen":
        udp_listen(int(args[0]), int(args[1]), float(args[2]))
    elif mode == "udp-send":
        udp_send(args[0], int(args[1]), int(args[2]))
    else:
        raise SystemExit(f"unknown mode {mode}")
