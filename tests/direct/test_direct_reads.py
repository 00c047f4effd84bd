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
from sidecar.metrics import Metrics

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


class Streams:
    """``count`` enrolled connections on socket pairs: ``send(i, data)`` writes to the i-th
    connection's peer."""

    def __init__(self, direct: Any, count: int) -> None:
        self.pairs = [socket.socketpair() for _ in range(count)]
        self.conns = [OpenConnection() for _ in range(count)]
        for (ours, _), conn in zip(self.pairs, self.conns, strict=True):
            ours.setblocking(False)
            assert direct.enroll(conn, ours.fileno(), conn.relay) is not None

    def send(self, i: int, data: bytes) -> None:
        self.pairs[i][1].sendall(data)

    def close(self) -> None:
        for a, b in self.pairs:
            a.close()
            b.close()


async def start_batching(direct: Any, streams: Streams) -> None:
    """Two reads of the first stream 30 ms apart: within the interval (over 30 ms), and slow over
    the streams enrolled if the interval is at most 3 ms per stream (SLOW: 10 intervals)."""
    conn = streams.conns[0]
    streams.send(0, b"x")
    await delivered(conn, b"x")
    assert not direct.batching  # the first wakeup: nothing to compare it with
    await asyncio.sleep(0.03)
    streams.send(0, b"y")
    await delivered(conn, b"xy")
    assert direct.batching and direct.batched == 0


async def test_reads_close_together_are_batched_until_an_interval_finds_nothing() -> None:
    """Two wakeups with bytes closer together than the interval, while the streams are slow,
    start batching: the set is then read by its timer, once per interval, and every byte still
    arrives, in order. The first interval that finds nothing ends it, and bytes wake the loop
    through the set again. The timer's reads are not told to the idle poller: polling for them
    would spin between intervals."""
    loop = asyncio.get_running_loop()
    poller = CountingPoller(loop)
    direct = DirectReads(loop, poller, 100_000)  # 100 ms
    metrics = Metrics()
    metrics.watch_stream_reads(direct)
    scrape = metrics.registry.get_sample_value
    streams = Streams(direct, 100)
    conn = streams.conns[0]
    try:
        await start_batching(direct, streams)
        assert scrape("sidecar_stream_batching") == 1
        for part in (b"c", b"d", b"e"):  # three writes before the loop runs again
            streams.send(0, part)
        await delivered(conn, b"xycde")
        assert direct.batched >= 1 and direct.reads == 3  # read by the timer, together
        assert poller.notes == 2  # x and y
        async with asyncio.timeout(5):
            while direct.batching:  # an interval with nothing read ends it
                await asyncio.sleep(0.01)
        assert scrape("sidecar_stream_batching") == 0
        timed = direct.batched
        await asyncio.sleep(0.3)
        assert direct.batched == timed  # the timer is off once batching ends
        streams.send(0, b"f")
        await delivered(conn, b"xycdef")  # the set wakes the loop again
        assert not direct.batching and direct.batched == timed and direct.reads == 4
        assert poller.notes == 3
        # The counters an operator reads, as the set counted them.
        assert scrape("sidecar_stream_batched_wakeups_total") == timed
        assert scrape("sidecar_stream_reads_total") == 4
        assert scrape("sidecar_streams_read_directly_total") == direct.enrolled == 100
    finally:
        direct.close()
        streams.close()


@pytest.mark.parametrize(
    ("batch_us", "count", "pause"),
    [
        pytest.param(1000, 100, 0.05, id="wakeups-further-apart-than-the-interval"),
        # Reads closer together than the interval, of too few streams to be slow against it:
        # one stream, an event every millisecond, a 50 ms interval.
        pytest.param(50_000, 3, 0.001, id="a-fast-stream"),
    ],
)
async def test_reads_that_are_not_batched_are_read_as_they_arrive(batch_us: int, count: int, pause: float) -> None:
    loop = asyncio.get_running_loop()
    direct = DirectReads(loop, IdlePoller(loop, 0), batch_us)
    streams = Streams(direct, count)
    try:
        want = b""
        for i in range(12):
            part = b"%d;" % i
            streams.send(0, part)
            want += part
            await delivered(streams.conns[0], want)
            assert not direct.batching
            await asyncio.sleep(pause)
        assert direct.batched == 0 and direct.reads == 12
    finally:
        direct.close()
        streams.close()


@pytest.mark.parametrize(
    ("count", "senders", "batching", "timer_wakeups"),
    [
        # All 200 streams have bytes: the timer's wakeup takes a full batch (64), the streams are
        # no longer slow, and the set's own wakeups read the rest at once.
        pytest.param(200, 200, False, 1, id="a-burst-ends-batching"),
        # 70 of 1000 streams: the timer's wakeup takes 64, the next, armed at once rather than
        # an interval on, the other 6; the 70 reads count as one interval's, so the streams are
        # still slow and batching goes on (its next wakeup is 500 ms away).
        pytest.param(1000, 70, True, 2, id="a-full-batch-is-followed-at-once"),
    ],
)
async def test_more_reads_than_a_batch_takes_while_batching(
    count: int, senders: int, batching: bool, timer_wakeups: int
) -> None:
    loop = asyncio.get_running_loop()
    direct = DirectReads(loop, IdlePoller(loop, 0), 500_000)  # 500 ms
    streams = Streams(direct, count)
    try:
        await start_batching(direct, streams)
        timed = direct.batched
        for i in range(senders):
            streams.send(i, b"%d;" % i)
        for i, conn in enumerate(streams.conns[:senders]):
            await delivered(conn, (b"xy" if i == 0 else b"") + b"%d;" % i)
        assert direct.batching == batching and direct.batched == timed + timer_wakeups
    finally:
        direct.close()
        streams.close()


async def test_closing_while_batching_stops_the_timer_and_reads_nothing_more() -> None:
    loop = asyncio.get_running_loop()
    direct = DirectReads(loop, IdlePoller(loop, 0), 100_000)
    streams = Streams(direct, 100)
    conn = streams.conns[0]
    try:
        await start_batching(direct, streams)
        streams.send(0, b"c")
        direct.close()
        await asyncio.sleep(0.2)  # past the interval: nothing is read, nothing fails
        assert conn.got() == b"xy" and streams.pairs[0][0].recv(16) == b"c"
        assert direct.enroll(conn, streams.pairs[0][0].fileno(), conn.relay) is None
    finally:
        direct.close()  # a second close does nothing
        streams.close()
