"""One-shot HTTP/1.1 clients, as ``curl`` is one: each sends one request on a new connection,
reads its response to the body's last byte and closes at once; every other one closes by a
reset (SO_LINGER 0). Run as a process of its own, so that its reads and closes race the
sidecar's event loop as a real client's do.

``python oneshot_clients.py PORT PREFIX COUNT TARGET...``: request ``i`` (0-based) goes to
``TARGET[i % len(TARGET)]`` with ``X-Correlation-ID: PREFIX-i`` and ``X-Session-Final: true``; it
closes by a reset when ``i // len(TARGET)`` is odd. One line per request on stdout:
``PREFIX-i STATUS WHOLE`` (WHOLE: 1 when the body came whole).
"""

from __future__ import annotations

import socket
import struct
import sys


def body_done(head: bytes, body: bytes) -> bool:
    """Whether ``body`` is the whole body its ``head`` frames (chunked, or by Content-Length)."""
    for line in head.lower().split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name == b"content-length":
            return len(body) >= int(value)
    return body.endswith(b"\r\n0\r\n\r\n")  # (plain chunks: no extension, no trailer)


def one(port: int, session: str, target: str, reset: bool) -> tuple[int, bool]:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        f"GET {target} HTTP/1.1\r\nHost: x\r\nX-Correlation-ID: {session}\r\nX-Session-Final: true\r\n\r\n".encode()
    )
    got = b""
    while b"\r\n\r\n" not in got:
        data = sock.recv(65536)
        if not data:
            break
        got += data
    head, _, body = got.partition(b"\r\n\r\n")
    while not body_done(head, body):
        data = sock.recv(65536)
        if not data:
            break
        body += data
    if reset:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # at once, the last byte read
    status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/") else 0
    return status, body_done(head, body)


def main() -> None:
    port, prefix, count, targets = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    for i in range(count):
        session = f"{prefix}-{i}"
        status, whole = one(port, session, targets[i % len(targets)], (i // len(targets)) % 2 == 1)
        print(session, status, int(whole), flush=True)


if __name__ == "__main__":
    main()
