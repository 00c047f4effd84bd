"""DirectReads itself (sidecar.engine.direct, compiled build), on real sockets and its real epoll
set: what the wire tests in test_direct_io.py cannot arrange on purpose."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from sidecar.engine.direct import DirectReads
from sidecar.engine.idle_poll import IdlePoller
from sidecar.engine.relay import LENGTH, BodyRelay, ClientOutput

pytestmark = pytest.mark.skipif(DirectReads is None, reason="direct socket I/O is compiled only")


class RecordingTransport:
    """The client side of a relay: what it was given to write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)


class LeavingConnection:
    """An enrolled connection whose body ends at its first read and, as it ends, makes another
    connection leave (as a callback run by one read can end another stream)."""

    def __init__(self, direct: Any, fd: int, length: int) -> None:
        self.direct, self.fd = direct, fd
        self.sink = RecordingTransport()
        self.relay = BodyRelay(ClientOutput(self.sink), LENGTH, length, 0)
        self.entry: Any = None  # its DirectReads entry, to leave with
        self.other: LeavingConnection | None = None
        self.ended = 0

    def body_end(self, extra: bool) -> None:
        self.ended += 1
        self.direct.leave(self.entry, self.fd)
        other = self.other
        assert other is not None
        self.direct.leave(other.entry, other.fd)

    def direct_stop(self) -> None:
        raise AssertionError("no close or error happens here")

    invalid_body = _fail = direct_stop


async def test_a_connection_that_leaves_while_its_event_waits_in_the_batch_is_not_read() -> None:
    """Both sockets are ready in one wakeup; the first one read ends the other's enrolment:
    the other's event, already taken, is skipped (its bytes stay unread in its socket)."""
    loop = asyncio.get_running_loop()
    direct = DirectReads(loop, IdlePoller(loop, 0))
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        conns = []
        for ours, _ in pairs:
            ours.setblocking(False)
            conn = LeavingConnection(direct, ours.fileno(), 5)
            conn.entry = direct.enroll(conn, ours.fileno(), conn.relay)
            assert conn.entry is not None
            conns.append(conn)
        conns[0].other, conns[1].other = conns[1], conns[0]
        for _, theirs in pairs:
            theirs.sendall(b"hello")  # both ready before the loop next waits
        await asyncio.sleep(0.1)
        assert sorted(c.ended for c in conns) == [0, 1] and direct.reads == 1
        first, second = conns if conns[0].ended else conns[::-1]
        assert first.sink.writes == [b"hello"] and second.sink.writes == []
        assert second.relay.reads == 0
        assert pairs[conns.index(second)][0].recv(16) == b"hello"  # never read by the epoll set
    finally:
        direct.close()
        for a, b in pairs:
            a.close()
            b.close()
