"""Upstream side of the protocol-level engine: keep-alive connections, pooled per upstream.

An :class:`UpstreamConnection` carries one request at a time (no upstream pipelining) for the
:class:`UpstreamRequest` (the fast engine's exchange) bound to it. The exchange writes its
request through :meth:`~UpstreamConnection.send`; the connection hands it the response head and
the response's end, exactly once each:

- llhttp (:mod:`sidecar.engine.parsers`) parses and checks each response head, fed exactly the
  head's bytes (up to its empty line; 1xx interim heads are skipped); the exchange gets the head
  as bytes plus offsets (:mod:`sidecar.engine.head` reads them) in ``response_head``, which
  returns the :class:`~sidecar.engine.relay.BodyRelay` the body goes through (None: no body);
- every later read goes to that relay, which passes the body's bytes to the client as they
  arrive and finds the body's end (no Python call per chunk); then ``response_complete``, or
  ``upstream_failed`` if the upstream broke off or sent malformed framing.

:class:`UpstreamPool` bounds the connections to one upstream, hands idle ones out most-recently-used first (so the
ones left idle long enough to be closed by the upstream are the ones that age out), and queues
requests when the bound is reached.

A pooled connection is checked each time it is reused (:meth:`UpstreamConnection.usable`):
anything that arrived since its last response, a FIN or stray bytes, makes it unusable. Bytes an
upstream sends after a complete response would otherwise be read as the next request's
response: another client's answer cut short or replaced. The loop has often seen them already
(the connection then left the pool), but not always: an ended stream's socket stays out of the
loop's epoll set until its transport reads again, and a new request can take the connection
earlier in the same loop iteration. A plain connection is peeked at (one non-blocking
``MSG_PEEK`` recv); a TLS one, whose socket also carries records that are not responses, is
polled only once idle for :data:`STALE_CHECK_AFTER`. The request then goes to a fresh
connection: a retry that happens strictly before any request byte was sent. Once bytes went out
on a connection, a failure is reported, never replayed (the upstream may have started
generating). Bytes that arrive after the check are the race HTTP/1.1 keep-alive leaves to every
proxy.

``https://`` upstreams use the loop's TLS transport over the same protocol; the handshake is
part of connecting (within the connect timeout). The poll then watches the TCP socket under the
TLS layer: a close_notify, a FIN or any other record not yet processed makes it readable, so a
close is seen as it is for plain connections, and a record that is not application data (a late
session ticket) is taken for stray bytes: the connection is replaced, which costs a handshake,
never a request. Once the loop has processed a close_notify the TLS transport reports
``is_closing()``; a FIN without one leaves the socket readable until ``connection_lost`` runs.

Times here (``idle_since``, the ``now`` arguments) are ``time.perf_counter()`` readings the
exchange already took for its metrics: the hot path reads the clock as few times as possible.
"""

from __future__ import annotations

import asyncio
import select
import ssl
from collections import deque
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol, cast

from sidecar.engine.direct import ENROLL_AFTER
from sidecar.engine.direct import DirectSocket as new_direct_socket  # (the compiled layout cimports the type)
from sidecar.engine.flow import CLIENT_FULL, DIRECT, ReadFlow
from sidecar.engine.head import cut, head_end, locate
from sidecar.engine.idle_poll import IdlePoller
from sidecar.engine.parsers import ParseError, ResponseParser
from sidecar.engine.relay import BodyRelay
from sidecar.errors import failure_reason
from sidecar.tls import refused_after_handshake
from sidecar.usage import LAST_BYTES, TAIL_READS

if TYPE_CHECKING:
    from sidecar.engine.relay import Writer

# A TLS connection back from the pool sooner than this is not polled first (saves a syscall per
# request under load, where reuse is sub-millisecond to a few milliseconds). Upstreams close idle
# keep-alive connections after seconds; a close that lands within this window and in the same
# loop iteration as the reuse is answered as an upstream failure (never replayed), like any close
# after sending. (A FIN without close_notify, processed earlier in that iteration, falls in the
# same window: the TLS transport reports it only at connection_lost, one iteration later.)
STALE_CHECK_AFTER = 0.05

_ENROLL_RETRY = 64  # reads of a body after an enrolment that could not be made before the next try
# UpstreamConnection.first_bytes: the body's first bytes are wanted, as they came / chunked.
FIRST_RAW, FIRST_CHUNKED = 1, 2


if TYPE_CHECKING:

    class _Timed(Protocol):
        connect_timeout: float  # an UpstreamRequest's (set by the subclass): bounds the opening


class UpstreamRequest:
    """What a connection needs from the request it carries: the base of
    :class:`sidecar.engine.fast_exchange.Exchange` (compiled, an extension type whose hot methods
    the connection calls in C). Once bound, a connection calls exactly one of ``response_complete`` /
    ``upstream_failed`` / ``connect_failed`` (after at most one ``response_head``), unless the
    exchange releases it first."""

    __slots__ = ()

    @property
    def wants_connection(self) -> bool:
        raise NotImplementedError

    def attach(self, conn: UpstreamConnection) -> None:
        raise NotImplementedError

    def connect_failed(self, kind: str, exc: BaseException) -> None:
        """No connection: ``kind`` is ``timeout``, ``connect``, or ``tls`` (the upstream refused
        the TLS session on a connection that was already bound to the exchange)."""
        raise NotImplementedError

    def peer_full(self, full: bool) -> None:
        raise NotImplementedError

    def response_head(
        self, status: int, raw: bytes, start: int, first: int, end: int, length: int, now: float
    ) -> BodyRelay | None:
        """The final response head (``length``: its declared Content-Length, -1 without one); the
        relay its body goes through, or None when it has none."""
        raise NotImplementedError

    def head_sent(self) -> None:
        """The head went to the client (it may hear of it later, at the latest on its end)."""
        raise NotImplementedError

    def response_start(self, data: bytes, chunked: bool) -> bool:
        """A read of the body's beginning, for a response whose head set the connection's
        ``first_bytes`` (``chunked``: with its chunked framing); True once no more is wanted."""
        raise NotImplementedError

    def response_complete(self, now: float) -> None:
        raise NotImplementedError

    def upstream_failed(self, message: str) -> None:
        raise NotImplementedError


class UpstreamConnection:
    """One keep-alive connection to an upstream; relays one response at a time to its exchange
    (an asyncio protocol by duck typing, like :class:`sidecar.engine.fast_connection.ClientConnection`)."""

    __slots__ = (
        "pool",
        "transport",
        "flow",
        "parser",
        "ex",
        "lost",
        "holds_slot",
        "_poll",
        "pieces",
        "raw_at",
        "scan_at",
        "fed",
        "relay",
        "keep_alive",
        "reusable",
        "sent_all",
        "write_paused",
        "idle_since",
        "unanswered",
        "direct",
        "sock",
        "enroll_at",
        "first_bytes",
        "usage",
        "tail_reads",
        "tail_at",
        "tail_seen",
        "tail_extra",
    )

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = ResponseParser()  # the response heads' parser, for the connection's life
        self.ex: UpstreamRequest | None = None
        self.lost = False
        self.holds_slot = True  # counts towards the pool's bound until lost or dropped
        # The reads since the response began, until its final head is complete (joined once
        # then: no copy per read for a head that arrives in pieces). The head being parsed
        # starts ``raw_at`` bytes in (after any 1xx interim response); the parser has been fed
        # ``fed`` bytes, and the head's end is searched from ``scan_at``.
        self.pieces: list[bytes] = []
        self.raw_at = 0
        self.scan_at = 0
        self.fed = 0
        self.relay: BodyRelay | None = None  # while a response body is relayed
        self.keep_alive = True
        self.reusable = True
        self.sent_all = False  # the whole request went out (a response before that: never reused)
        self.write_paused = False
        self.idle_since = 0.0
        self.unanswered = True  # no response completed on it yet
        self.direct: object = None  # its entry in the pool's DirectReads while enrolled
        # Its socket (sidecar.engine.direct.DirectSocket) where the pool has DirectReads and the
        # upstream is plain TCP: requests are written through it and long bodies may be read directly.
        self.sock: Writer | None = None
        self.enroll_at = ENROLL_AFTER  # the relay's read count at which to enrol its body next
        # Set by the exchange for a response whose body's first bytes it wants (FIRST_RAW, or
        # FIRST_CHUNKED with the framing): reads go to it until it has them; 0 otherwise.
        self.first_bytes = 0
        # The usage reader of the response (sidecar.usage.UsageReader), set by the exchange for
        # an accounted one (read_usage): it gets the body's last bytes once the body ended.
        # Meanwhile the connection keeps the last TAIL_READS reads its transport had (references
        # in a ring, ``tail_reads``, the next at ``tail_at``: no copy) and the stream thread a copy
        # of the last bytes it read (DirectReads.enroll's ``tail``); ``tail_seen``: the body bytes
        # read so far; ``tail_extra``: bytes after the body in its last read.
        self.usage: Any = None
        self.tail_reads: list[bytes | None] | None = None
        self.tail_at = 0
        self.tail_seen = 0
        self.tail_extra = 0

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.flow = ReadFlow(transport)
        self._poll = select.poll()
        self._poll.register(transport.get_extra_info("socket").fileno(), select.POLLIN)
        if self.pool.direct is not None and self.pool.tls is None:
            self.sock = new_direct_socket(transport)

    def data_received(self, data: bytes) -> None:
        self.pool.poller.note()
        relay = self.relay
        if relay is not None:  # the body: straight to the client
            self._body(relay, data)
            return
        if self.ex is None:  # bytes on an idle connection: nothing to pair them with, never reuse it
            self.reusable = False
            self.pool.drop(self)
            return
        self._head(data)

    def eof_received(self) -> bool | None:
        return None  # close; connection_lost ends or fails the response

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.direct:  # (never, unless a close bypassed _unbind: the socket leaves the set as it closes)
            tail = self.pool.direct.leave(self.direct, -1)
            self.direct = None
            if tail is not None and self.usage is not None:
                self._thread_tail(tail, 0)
        self.pool.discard(self)
        ex = self.ex
        if ex is None:
            return
        relay = self.relay
        if relay is not None and exc is None and relay.eof():  # the close delimits the body
            self.keep_alive = False
            self._complete(perf_counter())
            return
        self._unbind()
        if self.unanswered and relay is None and self.pool.tls is not None:
            # A TLS 1.3 server checks the client's certificate after the client's side of the
            # handshake is done, and refuses with an alert the client reads only now, or (on
            # asyncio's TLS) with a bare close: the request never reached the application, like
            # a refused connect. A pooled connection's close is never a refusal.
            refusal = exc if isinstance(exc, ssl.SSLError) else None
            if refusal is None and not self.pieces:
                refusal = refused_after_handshake(self.transport)
            if refusal is not None:
                ex.connect_failed("tls", refusal)
                return
        if exc is None:
            ex.upstream_failed(
                "the upstream closed the connection" + ("" if relay is not None else " before responding")
            )
        else:
            ex.upstream_failed(_failed(exc))

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.ex is not None:
            self.ex.peer_full(True)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.ex is not None:
            self.ex.peer_full(False)

    # -- used by the pool and the exchange ------------------------------------------------

    def bind(self, ex: UpstreamRequest, client_paused: bool) -> None:
        """Carry ``ex``'s request (``client_paused``: its client cannot take more right now)."""
        self.ex = ex
        self.sent_all = False
        if client_paused:
            self.flow.pause(CLIENT_FULL)
        if self.write_paused:
            ex.peer_full(True)

    def usable(self, now: float) -> bool:
        """Still open, and nothing (a FIN, stray bytes) arrived since its last response (see the
        module docstring: a TLS connection is polled only after :data:`STALE_CHECK_AFTER` of
        idleness)."""
        transport = self.transport
        assert transport is not None  # pooled connections are connected
        if self.lost or transport.is_closing():
            return False
        if self.pool.tls is not None:
            return now - self.idle_since < STALE_CHECK_AFTER or not self._poll.poll(0)
        sock = self.sock
        return not (sock.has_input() if sock is not None else self._poll.poll(0))

    def send(self, parts: list[bytes], last: bool) -> None:
        """Write request bytes, ``parts`` in order in one write (``last``: the request is complete
        with them)."""
        self.sent_all = last
        if self.sock is not None:
            self.sock.writev(parts)
        else:
            self.transport.write(parts[0] if len(parts) == 1 else b"".join(parts))  # type: ignore[union-attr]

    def client_full(self, full: bool) -> None:
        """The client's write buffer went above (or back below) its high-water mark."""
        if full:
            self.flow.pause(CLIENT_FULL)
            if self.direct:  # reads stop here too (and stay with the transport from now on)
                self.direct_stop()
        else:
            self.flow.resume(CLIENT_FULL)

    def direct_stop(self) -> None:
        """Leave the pool's DirectReads: the transport reads the socket again (unless paused
        for another reason)."""
        entry = self.direct
        if entry is not None:
            self.direct = None
            tail = self.pool.direct.leave(entry, self.sock.fd)  # type: ignore[union-attr]  # (enrolled: it has one)
            self.flow.resume(DIRECT)
            if tail is not None and self.usage is not None:
                self._thread_tail(tail, 0)

    def _thread_tail(self, tail: tuple[bytes, int], extra: int) -> None:
        """What the stream thread kept of the body's bytes it read (``(last bytes, how many it
        read)``) to the usage reader (``extra``: bytes after the body at their end)."""
        data, relayed = tail
        self.tail_seen += relayed
        if data:
            self.usage.last_reads((data,), self.tail_seen, extra)

    def read_usage(self, usage: Any) -> None:
        """The response's body goes to ``usage`` (a :class:`~sidecar.usage.UsageReader`): its
        first reads (``first_bytes``, set by the exchange) and its last bytes once it ended."""
        self.usage = usage
        self.tail_reads = None  # (made at the first read the reader's beginning does not hold)
        self.tail_at = 0

    def _reads_to_usage(self, extra: int) -> None:
        """The last reads the transport had (since the reader last got any) to the usage reader
        (``extra``: bytes after the body at their end)."""
        reads = self.tail_reads
        if reads is None:  # none since: the reader's beginning holds them
            return
        at = self.tail_at
        if reads[at - 1 if at else TAIL_READS - 1] is not None:  # (the newest read)
            self.usage.last_reads(reads[at:] + reads[:at], self.tail_seen, extra)
        self.tail_reads = None
        self.tail_at = 0

    def _usage_end(self) -> None:
        """The body ended (or stops here): the usage reader gets its last bytes, from the stream
        thread if it relayed them, else from the transport's last reads."""
        entry = self.direct
        if entry is not None:
            self.direct = None
            tail = self.pool.direct.leave(entry, self.sock.fd)  # type: ignore[union-attr]  # (enrolled: it has one)
            self.flow.resume(DIRECT)
            if tail is not None:
                self._thread_tail(tail, self.tail_extra)
        else:
            self._reads_to_usage(self.tail_extra)

    def client_gone(self) -> None:
        """The client connection closed: a body whose end the stream thread already sent to the
        client completes now (``response_complete``), though the thread's note of it has not reached
        the loop yet (see :meth:`DirectReads.settle`)."""
        entry = self.direct
        if entry:
            self.pool.direct.settle(entry)

    def end_usage(self) -> None:
        """The response ends here, whole or not: the usage reader gets the last bytes read of the
        body, and no more (the exchange decides what it counts)."""
        if self.usage is not None:
            self._usage_end()
            self.usage = None
            self.tail_reads = None
            self.tail_seen = self.tail_extra = 0

    def abort(self) -> None:
        """The exchange gave up on this connection (client gone, timeout, bad request body)."""
        self._unbind()
        self.pool.drop(self)

    def _unbind(self) -> None:
        ex = self.ex
        self.ex = None
        self.relay = None
        self.first_bytes = 0
        if self.usage is not None:  # the reader gets what was read of the body
            self.end_usage()
        if self.direct:
            self.direct_stop()
        if self.flow.reasons:
            self.flow.clear()
        if ex is not None and self.write_paused:
            ex.peer_full(False)

    def _head(self, data: bytes) -> None:
        """Response head bytes: parse each complete head; at the final one, hand it to the
        exchange and pass what follows it in ``data`` to the body relay it returns."""
        pieces = self.pieces
        pieces.append(data)
        raw = data if len(pieces) == 1 else b"".join(pieces)
        max_head = self.pool.max_head
        while True:
            k = head_end(raw, self.scan_at)
            if k < 0:
                at = self.raw_at
                if at:  # interim heads ended in these bytes: drop them (once per read, not per head),
                    # so an upstream sending them without end holds one head of memory, not all
                    raw = cut(raw, at, len(raw))
                    pieces[:] = [raw]
                    self.fed -= at
                    self.raw_at = 0
                if len(raw) - self.raw_at > max_head:
                    self._fail(f"response head larger than {max_head} bytes")
                    return
                self.scan_at = len(raw) - 3 if len(raw) - 3 > self.raw_at else self.raw_at
                if len(pieces) > 1:
                    pieces[:] = [raw]
                return
            stop = k + 4
            try:
                status = self.parser.feed_head(raw, self.fed, stop)
            except ParseError as exc:
                self._fail(f"invalid response: {exc}")
                return
            self.fed = self.scan_at = stop
            if status == 0:  # empty lines before the status line
                continue
            start, first, end = locate(raw, self.raw_at)
            if end + 2 - start > max_head:  # complete, but over the cap: never relayed
                self._fail(f"response head larger than {max_head} bytes")
                return
            if status < 200:  # 1xx interim responses are not relayed (we never send Expect upstream)
                self.raw_at = stop
                continue
            break
        self.keep_alive = self.parser.keep_alive
        pieces.clear()
        self.raw_at = self.scan_at = self.fed = 0
        ex = self.ex
        assert ex is not None
        now = perf_counter()
        try:
            relay = ex.response_head(status, raw, start, first, end, self.parser.length, now)
        except ParseError as exc:  # framing the sidecar cannot relay faithfully
            self._fail(f"invalid response: {exc}")
            return
        except Exception as exc:  # a defect: it costs this response, not the connection's reads
            self._fail(f"response head not relayed: {exc!r}")
            return
        if relay is None or relay.done:  # no body (or an empty one)
            if relay is None and status != 204 and status != 304:
                self.reusable = False  # a response to HEAD: its length says nothing of what follows
            if stop < len(raw):
                self.reusable = False
            self._complete(now)
            return
        self.relay = relay
        self.enroll_at = ENROLL_AFTER
        if stop < len(raw):
            self._body(relay, cut(raw, stop, len(raw)))  # the body's first bytes leave with the head
        else:
            relay.output.flush()  # the head alone
        if self.ex is ex:
            ex.head_sent()

    def _body(self, relay: BodyRelay, data: bytes) -> None:
        """Response body bytes: to the client through the relay; complete at the body's end."""
        if self.first_bytes:  # (only a response whose exchange asked: see first_bytes)
            assert self.ex is not None
            if self.ex.response_start(data, self.first_bytes == FIRST_CHUNKED):
                self.first_bytes = 0
            else:
                self.enroll_at = relay.reads + 2  # its next read comes here too
        reader = self.usage
        if reader is not None:  # an accounted response: its last reads are kept, unless the
            # reader's copy of the body's beginning has them (a body of one read, most often)
            seen = self.tail_seen = self.tail_seen + len(data)
            if not reader.holds(seen):
                reads = self.tail_reads
                if reads is None:
                    reads = self.tail_reads = [None] * TAIL_READS
                elif len(data) >= LAST_BYTES:  # it holds the whole tail: the older reads go (what
                    # the ring keeps stays below TAIL_READS - 1 times LAST_BYTES, plus one read)
                    for k in range(TAIL_READS):
                        reads[k] = None
                at = self.tail_at
                reads[at] = data
                self.tail_at = (at + 1) % TAIL_READS
        try:
            used = relay.feed(data)
        except ParseError as exc:
            self.invalid_body(exc)
            return
        if relay.done:
            self.body_end(len(data) - used)
        elif self.sock is not None and relay.reads >= self.enroll_at and self.sent_all and not self.flow.reasons:
            # A long body (a token stream, most likely): relayed by the pool's DirectReads.
            direct = self.pool.direct
            usage = self.usage is not None
            entry = direct.enroll(self, self.sock.fd, relay, usage)
            if entry is not None:
                if usage:  # the reader has the transport's reads; the thread keeps its own
                    self._reads_to_usage(0)
                self.direct = entry
                self.flow.pause(DIRECT)
                # Out of the loop's own epoll set too, unless the loop still has request bytes to
                # write (the set then keeps the socket for them: see DirectReads.unwatch).
                if not self.transport.get_write_buffer_size():  # type: ignore[union-attr]
                    direct.unwatch(self.sock.fd)
            else:  # not from here (or not to this client): try again later
                self.enroll_at = relay.reads + _ENROLL_RETRY

    def body_end(self, extra: int) -> None:
        """The relay reached the body's end (``extra``: the bytes that followed it in the same read)."""
        if extra:
            self.reusable = False  # bytes after a complete response
            self.tail_extra = extra
        self._complete(perf_counter())

    def invalid_body(self, exc: ParseError) -> None:
        """The relay found the body's framing malformed (nothing of that read was relayed)."""
        self._fail(f"invalid response: {exc}")

    def _complete(self, now: float) -> None:
        """The response is complete: back to the pool (or closed), then the exchange ends."""
        ex = self.ex
        assert ex is not None
        self._unbind()  # (the usage reader gets the body's last bytes)
        if self.keep_alive and self.reusable and self.sent_all:
            self.unanswered = False
            self.pool.release(self, now)
        else:
            self.pool.drop(self)
        ex.response_complete(now)

    def read_failed(self, exc: OSError) -> None:
        """A read of this connection's socket outside its transport (the stream thread's) met
        ``exc``, which the socket no longer holds: fail the response as the transport would."""
        self._fail(_failed(exc))

    def _fail(self, message: str) -> None:
        ex = self.ex
        self._unbind()
        self.pool.drop(self)
        if ex is not None:
            ex.upstream_failed(message)


def _failed(exc: BaseException) -> str:
    return f"connection to the upstream failed: {failure_reason(exc)}"


class UpstreamPool:
    """Keep-alive connections to one upstream ``host:port``, at most ``limit`` of them."""

    __slots__ = (
        "loop",
        "host",
        "port",
        "tls",
        "server_hostname",
        "limit",
        "max_head",
        "idle",
        "waiters",
        "total",
        "tasks",
        "closed",
        "poller",
        "direct",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        host: str,
        port: int,
        limit: int,
        max_head: int,
        poller: IdlePoller,
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        direct: Any = None,
    ) -> None:
        self.loop = loop
        self.poller = poller  # told of every read (see sidecar.engine.idle_poll)
        # Where long bodies are read (sidecar.engine.direct.DirectReads; None: the transports).
        self.direct = direct
        self.host = host
        self.port = port
        # TLS (https:// upstreams): the handshake is part of connecting, within the connect
        # timeout; ``server_hostname`` (None: ``host``) is the SNI and the name checked.
        self.tls = tls
        self.server_hostname = server_hostname
        self.limit = limit
        # A response head larger than this is a protocol error (502), never relayed.
        self.max_head = max_head
        # A stack (most recently used on top): a list, whose append and pop the compiled build
        # calls in C.
        self.idle: list[UpstreamConnection] = []
        self.waiters: deque[UpstreamRequest] = deque()
        self.total = 0  # connecting + open
        self.tasks: set[asyncio.Task[None]] = set()
        self.closed = False

    def take(self, now: float) -> UpstreamConnection | None:
        """An idle connection that is still usable, most recently used first, or None."""
        idle = self.idle
        while idle:
            conn = idle.pop()
            if conn.usable(now):
                return conn
            self.drop(conn)  # closed by the upstream while pooled: never written to
        return None

    def acquire(self, ex: UpstreamRequest) -> None:
        """No idle connection (``take`` gave none): open one for ``ex`` or queue it; it gets
        ``ex.attach`` or ``ex.connect_failed`` later."""
        if self.total < self.limit:
            self._open(ex)
        else:
            self.waiters.append(ex)

    def forget(self, ex: UpstreamRequest) -> None:
        """``ex`` ended while it waited for a connection: out of the queue (O(waiters); a long
        queue of abandoned requests would otherwise keep their heads and bodies)."""
        try:
            self.waiters.remove(ex)
        except ValueError:  # (it was being connected, not queued)
            pass

    def release(self, conn: UpstreamConnection, now: float) -> None:
        """A connection finished a response cleanly: give it to a waiter or keep it idle."""
        if self.closed:
            self.drop(conn)
            return
        waiters = self.waiters
        if waiters and not conn.usable(now):
            self.drop(conn)  # (which opens a connection for the next waiter)
            return
        while waiters:
            ex = waiters.popleft()
            if ex.wants_connection:
                ex.attach(conn)
                return
        conn.idle_since = now
        self.idle.append(conn)

    def drop(self, conn: UpstreamConnection) -> None:
        """Close a connection that must not be reused."""
        self._uncount(conn)
        if conn.transport is not None:
            conn.transport.abort()

    def discard(self, conn: UpstreamConnection) -> None:
        """The connection is gone (``connection_lost``)."""
        self._uncount(conn)
        try:
            self.idle.remove(conn)
        except ValueError:
            pass

    def close(self) -> None:
        self.closed = True
        for task in self.tasks:
            task.cancel()
        while self.idle:
            self.drop(self.idle.pop())
        self.waiters.clear()

    def _uncount(self, conn: UpstreamConnection) -> None:
        if conn.holds_slot:
            conn.holds_slot = False
            self.total -= 1
            self._wake()

    def _wake(self) -> None:
        waiters = self.waiters
        while waiters and self.total < self.limit and not self.closed:
            ex = waiters.popleft()
            if ex.wants_connection:
                self._open(ex)

    def _open(self, ex: UpstreamRequest) -> None:
        self.total += 1
        task = self.loop.create_task(self._connect(ex))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _connect(self, ex: UpstreamRequest) -> None:
        try:
            async with asyncio.timeout(cast("_Timed", ex).connect_timeout):
                if self.tls is None:
                    # (a protocol by its methods: compiled, it cannot subclass asyncio.Protocol)
                    _, conn = await self.loop.create_connection(  # type: ignore[type-var]
                        lambda: UpstreamConnection(self), self.host, self.port
                    )
                else:
                    _, conn = await self.loop.create_connection(  # type: ignore[type-var]
                        lambda: UpstreamConnection(self),
                        self.host,
                        self.port,
                        ssl=self.tls,
                        server_hostname=self.server_hostname or self.host,
                    )
        except TimeoutError as exc:
            self.total -= 1
            ex.connect_failed("timeout", exc)
            self._wake()
            return
        except OSError as exc:
            self.total -= 1
            ex.connect_failed("connect", exc)
            self._wake()
            return
        except asyncio.CancelledError:
            self.total -= 1
            raise
        assert isinstance(conn, UpstreamConnection)
        if conn.lost:
            ex.connect_failed("connect", ConnectionResetError("closed by the upstream right after connecting"))
        elif ex.wants_connection:
            ex.attach(conn)
        else:
            self.release(conn, perf_counter())
