"""A paced text/event-stream upstream: the stand-in inference gateway of the streaming cases.

It runs inside the load process of bench/stream_load.py, in the same event loop as the stream
driver (see there why). Answers every request (HTTP/1.1, keep-alive) with a chunked ``text/event-stream`` response
shaped by the query string: ``events`` (count, default 100), ``gap_us`` (pacing, default 20000)
and ``bytes`` (size of one ``data: ...`` event, default 110). The response head and the first
event leave together as soon as the request has been read; event k leaves k * gap_us after
that, on an absolute schedule (a late event does not delay the next ones); the last event
carries the terminating chunk. The ``X-Dynamo-Session-ID`` the proxy sent comes back as
``X-Seen-Session-ID``, so the harness can check each proxy's header injection.

:meth:`Pacer.take_stats` tells how late the events left since the previous call (an event's
lateness is its send time minus its scheduled time: jitter no proxy can be blamed for) and the
CPU time the upstream's callbacks took meanwhile (sends included, the event loop's own polling
not), to tell the upstream's share of the load process apart from the driver's.

Pacing uses a timerfd (nanosecond expiry, via ctypes on Python < 3.13) watched by the uvloop
event loop: the loop's own timers are rounded to milliseconds, as coarse as what is measured.
Events due within ``slack`` of a wake-up go out in that wake-up, which bounds the wake-ups at
large stream counts. Linux only, like the rest of the benchmark; it binds 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import ctypes
import heapq
import itertools
import os
import time
from urllib.parse import parse_qs, urlsplit

import httptools

HOST = "127.0.0.1"
DEFAULT_EVENTS = 100
DEFAULT_GAP_US = 20_000
DEFAULT_EVENT_BYTES = 110
MAX_EVENTS = 100_000
DEFAULT_SLACK_NS = 50_000
MAX_LATENESS_SAMPLES = 2_000_000  # bounded: one run of the harness sends at most a few 100k events
SESSION_IN = b"x-dynamo-session-id"

CLOCK_MONOTONIC = 1  # time.monotonic_ns() reads this clock too
TFD_NONBLOCK = os.O_NONBLOCK
TFD_CLOEXEC = os.O_CLOEXEC
TFD_TIMER_ABSTIME = 1


class TimerFd:
    """A CLOCK_MONOTONIC timerfd armed at absolute nanosecond times."""

    def __init__(self) -> None:
        if hasattr(os, "timerfd_create"):  # Python >= 3.13
            self.fd = os.timerfd_create(time.CLOCK_MONOTONIC, flags=TFD_NONBLOCK | TFD_CLOEXEC)
            self._settime = lambda ns: os.timerfd_settime_ns(  # type: ignore[attr-defined]
                self.fd, flags=TFD_TIMER_ABSTIME, initial=ns
            )
            return
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        spec = (ctypes.c_long * 4)()  # struct itimerspec: interval (sec, nsec), value (sec, nsec)
        settime = libc.timerfd_settime

        def set_ns(ns: int) -> None:
            spec[2], spec[3] = divmod(ns, 1_000_000_000)
            if settime(self.fd, TFD_TIMER_ABSTIME, spec, None) < 0:
                raise OSError(ctypes.get_errno(), "timerfd_settime")

        self._settime = set_ns

    def arm(self, at_ns: int) -> None:
        """Expire at ``at_ns`` (time.monotonic_ns()); 0 disarms."""
        self._settime(max(at_ns, 1) if at_ns else 0)

    def clear(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass


def event_chunk(size: int) -> bytes:
    """One SSE event of ``size`` bytes (an OpenAI-style delta; at least 89), framed as one HTTP chunk."""
    head = b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"'
    tail = b'"}}]}\n\n'
    event = head + b"x" * max(0, size - len(head) - len(tail)) + tail
    return b"%x\r\n%s\r\n" % (len(event), event)


class Pacer:
    """Sends the due events of every open stream; one timerfd for all of them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, slack_ns: int) -> None:
        self.timer = TimerFd()
        self.slack_ns = slack_ns
        self.heap: list[tuple[int, int, Stream]] = []
        self.armed_at = 0
        self.seq = itertools.count()
        self.lateness: list[int] = []
        self.cpu_ns = 0  # thread CPU time of the upstream's callbacks (Connection adds its own)
        loop.add_reader(self.timer.fd, self._fire)

    def add(self, stream: Stream) -> None:
        heapq.heappush(self.heap, (stream.next_due, next(self.seq), stream))
        self._arm()

    def _arm(self) -> None:
        due = self.heap[0][0] if self.heap else 0
        if due != self.armed_at:
            self.timer.arm(due)
            self.armed_at = due

    def _fire(self) -> None:
        cpu = time.thread_time_ns()
        self.timer.clear()
        self.armed_at = 0
        heap, lateness = self.heap, self.lateness
        horizon = time.monotonic_ns() + self.slack_ns
        while heap and heap[0][0] <= horizon:
            due, _, stream = heapq.heappop(heap)
            if len(lateness) < MAX_LATENESS_SAMPLES:
                lateness.append(time.monotonic_ns() - due)  # negative: sent early, within the slack
            if stream.send_next():
                heapq.heappush(heap, (stream.next_due, next(self.seq), stream))
        self._arm()
        self.cpu_ns += time.thread_time_ns() - cpu

    def take_stats(self) -> dict[str, float | int]:
        values, self.lateness = sorted(self.lateness), []
        cpu_s, self.cpu_ns = self.cpu_ns / 1e9, 0
        if not values:
            return {"events": 0, "cpu_s": cpu_s}

        def pct(q: float) -> float:
            return values[min(len(values) - 1, int(q * len(values)))] / 1e6

        return {
            "events": len(values),
            "cpu_s": cpu_s,
            "late_p50_ms": pct(0.5),
            "late_p99_ms": pct(0.99),
            "late_max_ms": values[-1] / 1e6,
        }


class Stream:
    """One paced response on one connection."""

    __slots__ = ("conn", "chunk", "left", "gap_ns", "start", "sent", "next_due")

    def __init__(self, conn: Connection, events: int, gap_ns: int, chunk: bytes, start: int) -> None:
        self.conn = conn
        self.chunk = chunk
        self.left = events
        self.gap_ns = gap_ns
        self.start = start
        self.sent = 0
        self.next_due = start

    def send_next(self, head: bytes = b"") -> bool:
        """Send the next event (after ``head``, in one write; the last event with the
        terminating chunk); whether more follow."""
        if self.conn.closed:
            return False
        self.left -= 1
        self.sent += 1
        if self.left > 0:
            self.conn.transport.write(head + self.chunk)
            self.next_due = self.start + self.sent * self.gap_ns
            return True
        self.conn.transport.write(head + self.chunk + b"0\r\n\r\n")
        self.conn.stream_done()
        return False


class Connection(asyncio.Protocol):
    """One client (proxy) connection: requests in order, one stream at a time."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.closed = False
        self.url = b""
        self.session = b""
        self.pending: list[tuple[bytes, bytes]] = []  # requests read while a stream runs
        self.streaming = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        cpu = time.thread_time_ns()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            self.transport.close()
        self.server.pacer.cpu_ns += time.thread_time_ns() - cpu

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.session = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == SESSION_IN:
            self.session = value

    def on_message_complete(self) -> None:
        self.pending.append((self.url, self.session))
        if not self.streaming:
            self._next_request()

    def stream_done(self) -> None:
        self.streaming = False
        if self.pending:
            self._next_request()

    def _next_request(self) -> None:
        url, session = self.pending.pop(0)
        query = parse_qs(urlsplit(url.decode("latin-1")).query)

        def param(name: str, default: int, low: int, high: int) -> int:
            try:
                return min(high, max(low, int(query[name][0])))
            except (KeyError, ValueError):
                return default

        events = param("events", DEFAULT_EVENTS, 1, MAX_EVENTS)
        gap_ns = param("gap_us", DEFAULT_GAP_US, 0, 60_000_000) * 1000
        chunk = self.server.chunk(param("bytes", DEFAULT_EVENT_BYTES, 1, 65536))
        head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\nX-Seen-Session-ID: %s\r\n\r\n" % session
        )
        self.streaming = True
        stream = Stream(self, events, gap_ns, chunk, time.monotonic_ns())
        if stream.send_next(head):  # the first event leaves with the head
            self.server.pacer.add(stream)


class Server:
    """The upstream's listener and its pacer, in the running event loop."""

    def __init__(self, slack_ns: int = DEFAULT_SLACK_NS) -> None:
        self.slack_ns = slack_ns
        self._chunks: dict[int, bytes] = {}
        self.pacer: Pacer = None  # type: ignore[assignment]
        self.listener: asyncio.Server | None = None

    def chunk(self, size: int) -> bytes:
        if size not in self._chunks:
            self._chunks[size] = event_chunk(size)
        return self._chunks[size]

    async def start(self, port: int) -> None:
        loop = asyncio.get_running_loop()
        self.pacer = Pacer(loop, self.slack_ns)
        self.listener = await loop.create_server(lambda: Connection(self), HOST, port, backlog=4096)
