"""The client side of the fast engine: one protocol object per client connection.

:class:`ClientConnection` feeds the client's bytes to a request parser
(:mod:`sidecar.engine.parsers`: llhttp, strict, no lenient flags), which calls back
:meth:`~ClientConnection.on_head`, :meth:`~ClientConnection.on_body` and
:meth:`~ClientConnection.on_message_complete` in stream order. Each head becomes an
:class:`~sidecar.engine.fast_exchange.Exchange`, queued in arrival order; only the head of the
queue is started (routed and forwarded), so pipelined requests are answered in order (reading
pauses while a later request waits). An exchange ends by calling :meth:`retired`
exactly once, which serves the next request or closes the connection.

Bytes for the client gather in ``output`` (:class:`~sidecar.engine.relay.ClientOutput`) and
leave in one write per event. One watchdog timer per connection enforces the keep-alive, head,
first-byte and idle timeouts (:meth:`_watchdog`). Backpressure (:mod:`sidecar.engine.flow`): the
client's write buffer above its high-water mark pauses reading the upstream connection of the
exchange at the head of the queue, and the reverse.
"""

from __future__ import annotations

import asyncio
import logging
import select
from collections import deque
from time import perf_counter
from typing import Any, cast

from sidecar import errors
from sidecar.engine import wire
from sidecar.engine.direct import DirectSocket
from sidecar.engine.fast_exchange import ClientBase, EngineState, Exchange, new_exchange
from sidecar.engine.flow import PIPELINED, STOPPED, ReadFlow
from sidecar.engine.head import LISTED, name_table, scan_request
from sidecar.engine.parsers import CallbackError, HeadTooLarge, Http09Request, ParseError, RequestParser, UpgradeRequest
from sidecar.engine.phases import ABORT, ANSWERING, CLOSE, CLOSED, DONE, QUEUED, READING
from sidecar.engine.relay import ClientOutput
from sidecar.engine.request_rules import plain, version_refusal

log = logging.getLogger("sidecar.engine")

# An idle keep-alive client connection is closed after this long (nginx's default).
KEEPALIVE_TIMEOUT = 75.0
# After answering a request whose body was not read, keep reading (and discarding) for this long
# before closing, so the client sees the answer instead of a reset.
LINGER_SECONDS = 2.0
# While a client's reading is paused (backpressure, a queued request) its close goes unseen: the
# watchdog looks for it this often (one poll(2) per paused connection).
PEER_CHECK = 1.0
# Requests of one connection queued at once: one read (up to 256 KiB) can hold thousands of tiny
# pipelined requests, each an exchange in memory; the one past this is refused (400), then the
# connection closes after the answers before it.
MAX_PIPELINED = 128
_MAX_PIPELINED = MAX_PIPELINED  # (the typed copy on_head reads; tests read the public name)

_INF = float("inf")
# Request headers whose presence takes the head checks and the forwarding off the fast path.
_SLOW_HEADERS = name_table(
    frozenset({wire.CONNECTION, wire.TRANSFER_ENCODING, wire.EXPECT, wire.UPGRADE, wire.XFF, wire.XFP})
)


class ClientConnection(ClientBase):
    """One client connection: parses requests, answers them in order (an asyncio protocol by
    duck typing: compiled, it is an extension type, which cannot derive from ``asyncio.Protocol``)."""

    __slots__ = (
        # connection (the base's: engine state, loop, output, flow, peer, write_paused)
        "clients",
        "transport",
        "lifecycle",
        # request heads and bodies as they are parsed
        "parser",
        "max_head",
        "parsing",
        "head_since",
        "head_timeout",
        # the queue of requests, answered in order
        "queue",
        "advancing",
        "idle_since",
        # the watchdog (the base's timer_due: when it fires next)
        "timer",
    )

    def __init__(
        self,
        shared: EngineState,
        loop: asyncio.AbstractEventLoop,
        clients: set[Any],
        max_head: int,
        head_timeout: float,
    ) -> None:
        super().__init__(shared, loop)
        # -- connection (transport: set by connection_made)
        self.clients = clients  # the engine's open connections: in it from connection_made to connection_lost
        self.lifecycle = READING  # (sidecar.engine.phases)
        # -- request heads and bodies as they are parsed
        self.parser = RequestParser(self, max_head)
        self.max_head = max_head
        self.parsing: Exchange | None = None  # the queued request whose body is being parsed
        self.head_since = 0.0  # when the head in progress began (0: none)
        self.head_timeout = head_timeout
        # -- the queue (idle_since: set by connection_made, then whenever it empties)
        self.queue: deque[Exchange] = deque()
        self.advancing = False  # advance() is running (it is entered again from the exchanges it drives)
        # -- the watchdog
        self.timer: asyncio.TimerHandle | None = None  # (see _watchdog)

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.output = ClientOutput(transport, None if DirectSocket is None else DirectSocket(transport))
        self.flow = ReadFlow(transport)
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]).encode() if peer else b""
        # What a request without X-Forwarded-* headers gets: built once per connection.
        self.xff_xfp = wire.XFF_LINE + self.peer + b"\r\n" + wire.XFP_LINE
        self.clients.add(self)
        self.idle_since = now = perf_counter()
        self.arm_watchdog(now + KEEPALIVE_TIMEOUT, now)

    def data_received(self, data: bytes) -> None:
        self.shared.poller.note()
        if self.lifecycle != READING:
            return
        try:
            self.parser.feed_data(data)
        except UpgradeRequest:
            self._stop()  # the upgrade/CONNECT request is queued and refused; nothing after it is read
        except HeadTooLarge:
            self._refuse(errors.headers_too_large(self.max_head), "headers_too_large")
        except Http09Request:
            self._refuse(*version_refusal(9))
        except ParseError as exc:
            if isinstance(exc, CallbackError):
                log.error("request parser callback failed", exc_info=exc.__cause__)
            self._refuse(errors.bad_request(f"malformed request: {exc}"), "bad_request")
        if self.parser.in_head:  # a head is in progress: it must complete in time (see _watchdog)
            if not self.head_since:
                now = perf_counter()
                self.head_since = now
                due = now + self.head_timeout
                if due < self.timer_due:
                    self.arm_watchdog(due, now)
        elif self.head_since:
            self.head_since = 0.0
        if self.queue:
            self.advance()
        else:
            self.output.flush()

    def eof_received(self) -> bool | None:
        return None  # the client is gone: close (connection_lost aborts what is in flight)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed()
        self.clients.discard(self)
        queue = self.queue
        while queue:
            queue.popleft().client_gone()

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.queue:
            conn = self.queue[0].conn
            if conn is not None:
                conn.client_full(True)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.queue:
            conn = self.queue[0].conn
            if conn is not None:
                conn.client_full(False)

    # -- parser callbacks (see sidecar.engine.parsers) --------------------------------

    def on_head(
        self,
        raw: bytes,
        first: int,
        end: int,
        method: bytes,
        target: bytes,
        version: int,
        keep_alive: bool,
        length: int,
    ) -> None:
        if self.lifecycle != READING:  # after a refused request, in the same read: never served, never kept
            self.parsing = None
            return
        ex = new_exchange(self, raw, first, end, method, target, keep_alive, length)
        head_bits = scan_request(raw, first, end, _SLOW_HEADERS)
        ex.slow_headers = head_bits & LISTED != 0
        if not plain(keep_alive, head_bits, method, target):  # (the request-head rules: rarely)
            ex.check_head(version, head_bits)
        queue = self.queue
        waits = bool(queue)  # an earlier request is still in progress
        queue.append(ex)
        self.parsing = ex
        if ex.error is None and len(queue) > _MAX_PIPELINED:
            ex.error = (errors.bad_request(f"more than {MAX_PIPELINED} pipelined requests"), "bad_request")
        if ex.error is not None:
            self._stop()  # answered, then closed: later bytes are never read as requests
        elif waits:
            self.pause(PIPELINED)

    def on_body(self, body: bytes) -> None:
        ex = self.parsing
        if ex is not None and ex.phase != DONE:  # (an answered or dropped request's body: dropped)
            ex.body.append(body)
            ex.body_size += len(body)

    def on_message_complete(self) -> None:
        ex = self.parsing
        if ex is not None:
            ex.complete = True
            self.parsing = None

    # -- the request queue ----------------------------------------------------------------

    def advance(self) -> None:
        """Start the oldest request if it is not started, move its body along, write output."""
        if not self.advancing and self.lifecycle != CLOSED:
            self.advancing = True
            queue = self.queue
            try:
                while queue:
                    ex = queue[0]
                    if ex.phase != QUEUED:
                        ex.pump()
                        break
                    try:
                        ex.start()
                    except Exception as exc:  # a bug must cost one request, not the listener
                        log.error("request failed in the engine: %r", exc, exc_info=exc)
                        ex.internal_error()
                    if queue and queue[0] is ex:
                        break  # started and in progress: it forwarded everything parsed so far
            finally:
                self.advancing = False
            if self.flow.reasons & PIPELINED and len(queue) <= 1:
                self.flow.resume(PIPELINED)
        self.output.flush()

    def retired(self, ex: Exchange, close: int) -> None:
        queue = self.queue
        if queue and queue[0] is ex:
            queue.popleft()
        self.shared.request_done()
        if self.lifecycle == CLOSED:  # gone or going: nothing more to serve
            return
        if close == ABORT:
            self.abort()
        elif close == CLOSE or self.shared.draining:
            self.close()  # (an unread rest of the request body is never read)
        else:
            if not queue:
                self.idle_since = perf_counter()
            self.advance()

    def flush(self) -> None:
        self.output.flush()

    def close(self) -> None:
        """Close after what was written; linger when unread request bytes may still arrive."""
        if self.lifecycle == CLOSED:
            return
        self.output.flush()
        lingers = self.parsing is not None or self.lifecycle == ANSWERING
        self._closed()
        self.queue.clear()  # pipelined requests never started: the client retries them elsewhere
        transport = self.transport
        if not lingers:
            transport.close()
            return
        # Closing with unread bytes in the socket makes the kernel send a reset that can destroy
        # the answer in flight: half-close, discard what still comes, then close.
        self.flow.clear()
        try:
            transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            transport.abort()
            return
        self.loop.call_later(LINGER_SECONDS, transport.abort)

    def abort(self) -> None:
        """Drop the connection now, discarding unsent output (an incomplete response stays incomplete)."""
        self.output.parts.clear()
        self._closed()
        self.transport.abort()

    def abort_all(self) -> None:
        """The engine is closing: abandon every request, drop the connection."""
        self._closed()
        queue = self.queue
        while queue:
            queue.popleft().client_gone()
        self.transport.abort()

    def _closed(self) -> None:
        """From here on nothing is read, written or timed on this connection."""
        self.lifecycle = CLOSED
        self.output.closed = True
        self._disarm()

    def _stop(self) -> None:
        self.lifecycle = ANSWERING
        self.flow.pause(STOPPED)

    def _refuse(self, exc: errors.ProxyError, reason: str) -> None:
        """The request stream is unusable from here: answer the offending request, read no more."""
        self._stop()
        ex = self.parsing
        self.parsing = None
        if ex is None:
            ex = new_exchange(self, b"", 0, 0, b"", b"", False, -1)
            ex.error = (exc, reason)
            self.queue.append(ex)
        elif ex.phase == QUEUED:
            ex.error = (exc, reason)  # its head was fine, its body was not: never forward it
        else:
            ex.refused(exc, reason)

    # -- the watchdog: keep-alive, head, first-byte and idle timeouts ---------------------------
    # One timer per connection, always armed while it is open, firing no later than the earliest
    # deadline: the keep-alive or head timeout when no request is in progress, else the deadline
    # of the request at the head of the queue (its body's arrival, the upstream's first byte or
    # the silence between reads). Requests only re-arm it when their deadline is earlier than
    # the armed one (on a busy connection: almost never); when it fires early it re-arms for the
    # deadline that applies then.

    def pause(self, reason: int) -> None:
        self.flow.pause(reason)
        now = perf_counter()
        if self.timer_due > now + PEER_CHECK:
            self.arm_watchdog(self.timer_due, now)  # (capped while paused: see watch)

    def _peer_closed(self) -> bool:
        """The client closed or reset its side: what a transport whose reading is paused does
        not report (its close stays unread behind the bytes not read yet; POLLRDHUP sees it)."""
        try:
            fd = self.transport.get_extra_info("socket").fileno()
            poller = select.poll()
            poller.register(fd, select.POLLRDHUP)
            return bool(poller.poll(0))
        except (AttributeError, OSError, ValueError):
            return False

    def arm_watchdog(self, due: float, now: float) -> None:
        """Fire the watchdog at ``due`` (capped at one keep-alive period from ``now``, and at
        :data:`PEER_CHECK` while reading is paused: the watchdog then looks for the client's close)."""
        timer = self.timer
        if timer is not None:
            timer.cancel()
        # the request may end any time: the connection then idles
        cap = now + (PEER_CHECK if self.flow.reasons & ~STOPPED else KEEPALIVE_TIMEOUT)
        if due > cap:
            due = cap
        self.timer_due = due
        self.timer = self.loop.call_later(due - now if due > now else 0.0, self._watchdog)

    def _disarm(self) -> None:
        timer = self.timer
        if timer is not None:
            timer.cancel()
            self.timer = None
        self.timer_due = _INF

    def _watchdog(self) -> None:
        self.timer = None
        self.timer_due = _INF
        if self.lifecycle == CLOSED:
            return
        if self.flow.reasons & ~STOPPED and self._peer_closed():
            self.transport.abort()  # as a read of the close would: its requests are abandoned
            return
        now = perf_counter()
        queue = self.queue
        if not queue:
            head_since = self.head_since
            if head_since and now - head_since >= self.head_timeout:
                self.head_since = 0.0
                self._refuse(
                    errors.request_timeout(f"the request head did not arrive within {self.head_timeout:g} s"),
                    errors.REQUEST_TIMEOUT,
                )
                self.advance()
                return
            if now - self.idle_since >= KEEPALIVE_TIMEOUT:
                self.close()
                return
            due = self.idle_since + KEEPALIVE_TIMEOUT
            if head_since and head_since + self.head_timeout < due:
                due = head_since + self.head_timeout
            self.arm_watchdog(due, now)
            return
        ex = queue[0]
        if ex.deadline(now) <= now:
            ex.timed_out(now)
            self.output.flush()
            if self.lifecycle == CLOSED or self.timer is not None:
                return
            now = perf_counter()
            if not queue:
                self.arm_watchdog(self.idle_since + KEEPALIVE_TIMEOUT, now)
                return
            ex = queue[0]
        self.arm_watchdog(ex.deadline(now), now)
