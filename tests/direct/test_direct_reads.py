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


class OpenConnection:
    """An enrolled connection whose body (``length`` bytes) is still going: it records what the
    relay wrote to its client."""

    def __init__(self, length: int = 1 << 20) -> None:
        self.sink = RecordingTransport()
        self.relay = BodyRelay(ClientOutput(self.sink), LENGTH, length, 0)

    def got(self) -> bytes:
        return b"".join(self.sink.writes)

    def direct_stop(self) -> None:
        raise AssertionError("no close or error happens here")

    body_end = invalid_body = _fail = direct_stop


class CountingPoller(IdlePoller):
    """An idle poller that never polls and counts the events it is told of."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop, 0)
        self.notes = 0

    def note(self) -> None:
        self.notes += 1


async def delivered(conn: OpenConnection, want: bytes, timeout: float = 5) -> None:
    async with asyncio.timeout(timeout):
        while conn.got() != want:
            assert want.startswith(conn.got()), conn.got()
            await asyncio.sleep(0.001)


async def test_reads_close_together_are_batched_until_an_interval_finds_nothing() -> None:
    """Two wakeups with bytes closer together than the interval start batching: the set is then
    read by its timer, once per interval, and every byte still arrives, in order. The first
    interval that finds nothing ends it, and bytes wake the loop through the set again. The
    timer's reads are not told to the idle poller: polling for them would spin between intervals."""
    loop = asyncio.get_running_loop()
    poller = CountingPoller(loop)
    direct = DirectReads(loop, poller, 50_000)  # 50 ms: wakeups 1 ms apart batch
    ours, theirs = socket.socketpair()
    try:
        ours.setblocking(False)
        conn = OpenConnection()
        assert direct.enroll(conn, ours.fileno(), conn.relay) is not None
        theirs.sendall(b"a")
        await delivered(conn, b"a")
        assert not direct.batching  # the first wakeup: nothing to compare it with
        theirs.sendall(b"b")
        await delivered(conn, b"ab")
        assert direct.batching and direct.batched == 0  # the second came well within 50 ms
        for part in (b"c", b"d", b"e"):  # three writes before the loop runs again
            theirs.sendall(part)
        await delivered(conn, b"abcde")
        assert direct.batched >= 1 and direct.reads == 3  # read by the timer, together
        assert poller.notes == 2  # a and b
        async with asyncio.timeout(5):
            while direct.batching:  # an interval with nothing read ends it
                await asyncio.sleep(0.01)
        timed = direct.batched
        await asyncio.sleep(0.2)
        assert direct.batched == timed  # the timer is off once batching ends
        theirs.sendall(b"f")
        await delivered(conn, b"abcdef")  # the set wakes the loop again
        assert not direct.batching and direct.batched == timed and direct.reads == 4
        assert poller.notes == 3
    finally:
        direct.close()
        ours.close()
        theirs.close()


async def test_wakeups_further_apart_than_the_interval_never_batch() -> None:
    loop = asyncio.get_running_loop()
    direct = DirectReads(loop, IdlePoller(loop, 0), 1000)  # the default 1 ms
    ours, theirs = socket.socketpair()
    try:
        ours.setblocking(False)
        conn = OpenConnection()
        assert direct.enroll(conn, ours.fileno(), conn.relay) is not None
        want = b""
        for part in (b"a", b"b", b"c", b"d"):
            theirs.sendall(part)
            want += part
            await delivered(conn, want)
            assert not direct.batching
            await asyncio.sleep(0.05)
        assert direct.batched == 0 and direct.reads == 4
    finally:
        direct.close()
        ours.close()
        theirs.close()


async def test_batching_serves_many_connections_and_a_full_batch_is_followed_at_once() -> None:
    """More connections with bytes than one wakeup takes (64): in each interval every one is
    read, the rest of a full batch at once rather than an interval later."""
    loop = asyncio.get_running_loop()
    direct = DirectReads(loop, IdlePoller(loop, 0), 200_000)  # 200 ms: only a full batch is read sooner
    pairs = [socket.socketpair() for _ in range(150)]
    conns = [OpenConnection() for _ in pairs]
    try:
        for (ours, _), conn in zip(pairs, conns, strict=True):
            ours.setblocking(False)
            assert direct.enroll(conn, ours.fileno(), conn.relay) is not None
        pairs[0][1].sendall(b"x")
        await delivered(conns[0], b"x")
        pairs[0][1].sendall(b"y")
        await delivered(conns[0], b"xy")
        assert direct.batching
        timed = direct.batched
        for i, (_, theirs) in enumerate(pairs):
            theirs.sendall(b"%d;" % i)
        for i, conn in enumerate(conns):
            await delivered(conn, (b"xy" if i == 0 else b"") + b"%d;" % i)
        # One timer wakeup took 64, the full batches' follow-ups the other 86: three, not one per
        # interval (a later interval, 200 ms on, would have needed over 0.4 s for the same).
        assert direct.batched - timed <= 4
    finally:
        direct.close()
        for a, b in pairs:
            a.close()
            b.close()


async def test_closing_while_batching_stops_the_timer_and_reads_nothing_more() -> None:
    loop = asyncio.get_running_loop()
    direct = DirectReads(loop, IdlePoller(loop, 0), 20_000)
    ours, theirs = socket.socketpair()
    try:
        ours.setblocking(False)
        conn = OpenConnection()
        assert direct.enroll(conn, ours.fileno(), conn.relay) is not None
        for want in (b"a", b"ab"):
            theirs.sendall(want[-1:])
            await delivered(conn, want)
        assert direct.batching
        theirs.sendall(b"c")
        direct.close()
        await asyncio.sleep(0.1)  # past the interval: nothing is read, nothing fails
        assert conn.got() == b"ab" and ours.recv(16) == b"c"
        assert direct.enroll(conn, ours.fileno(), conn.relay) is None
    finally:
        direct.close()  # a second close does nothing
        ours.close()
        theirs.close()
