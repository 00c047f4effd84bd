"""The protocol-level engine: asyncio Protocols, llhttp parsing, raw byte forwarding.

One :class:`_ClientConnection` per client connection feeds its bytes to a request parser
(:mod:`sidecar.engine.parsers`: llhttp, strict, no lenient flags), which hands it each
request head as its raw header block. Each head becomes an :class:`_Exchange`, queued in arrival
order; only the head of the queue is routed and forwarded, so pipelined requests are answered in
order (reading pauses while a later request waits). The exchange rebuilds only the request line
and the headers it changes: the client's header lines are copied as received minus hop-by-hop /
``Connection``-named / ``decision.drop`` / Host / Expect / framing ones, then come Host,
X-Forwarded-For, X-Forwarded-Proto, ``decision.add`` and the framing the parser found
(Content-Length or chunked): no header filter can remove or change a message's framing. It streams the body as it is parsed to a
pooled upstream connection (:mod:`sidecar.engine.fast_client`), and relays the response as it
arrives: the status line rebuilt for the client's HTTP version, the upstream's header lines
copied as received minus hop-by-hop and ``Connection``-named ones (:mod:`sidecar.engine.head`),
body bytes unchanged, re-framed as chunked when the upstream did not send a length
(close-delimited for HTTP/1.0 clients). Per request there is no task, no
future and no timer: everything runs from protocol callbacks, and one watchdog timer per client
connection enforces the keep-alive, first-byte and idle timeouts (re-armed lazily, so a busy
connection re-arms it about once per timeout period rather than once per request).

The request path runs tens of thousands of times a second on one core, so the per-request
steps are flattened into few methods (parse callbacks, :meth:`_Exchange.start` /
:meth:`_Exchange._forward`, :meth:`_Exchange.response_head`, :meth:`_Exchange.response_end`)
and the router reads the request's headers through a :class:`~sidecar.engine.head.HeaderBlock`
view of the raw block (nothing is built per header; :func:`~sidecar.engine.head.header_map`).
Rare paths (errors, unusual framing headers, timeouts) stay in their own small methods. Every
read also tells the engine's :class:`~sidecar.engine.idle_poll.IdlePoller`, which keeps the
loop polling instead of sleeping while events come close together.

Backpressure (:mod:`sidecar.engine.flow`): a write buffer above its high-water mark on one side
pauses reading on the other until it drains.

Framing the engine refuses with ``400 bad_request`` and a close (never forwarded): anything
llhttp rejects (Content-Length with Transfer-Encoding, duplicate Content-Length, bare LF,
whitespace before colons, ...), malformed chunks, a Transfer-Encoding other than ``chunked``
(optional whitespace around it allowed), Transfer-Encoding on HTTP/1.0, HTTP versions other
than 1.0 / 1.1, a missing (HTTP/1.1), repeated or invalid Host, and request targets that are
neither origin-form (``/path``) nor absolute-form (``http://host/path``, forwarded in
origin-form). The compiled build decodes chunked request bodies itself
(:mod:`sidecar.engine.llhttp_parser`), so it accepts the whitespace RFC 9112 allows in chunk
extensions, which llhttp refuses. ``https://`` upstreams are reached through the loop's TLS
transport (the deployment's context, built once; :mod:`sidecar.tls`) and pooled like plain ones.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import deque
from collections.abc import Mapping
from functools import partial
from http import HTTPStatus
from time import perf_counter
from typing import Any, cast

from sidecar import errors
from sidecar.errors import failure_reason
from sidecar import headers as h
from sidecar.compiled import is_compiled
from sidecar.engine.base import Engine
from sidecar.engine.fast_client import (
    BODY_FRAMED,
    BODY_NONE,
    BODY_UNTIL_EOF,
    RELAY_CHUNKED,
    RELAY_NONE,
    RELAY_RAW,
    STALE_CHECK_AFTER,
    UpstreamConnection,
    UpstreamPool,
)
from sidecar.engine.flow import CLIENT_FULL, PEER_FULL, PIPELINED, STOPPED, WAITING, ReadFlow
from sidecar.engine.head import (
    HAS_CONTENT_LENGTH,
    HAS_TRANSFER_ENCODING,
    HOST_INVALID,
    HOST_REPEATED,
    HOST_SEEN,
    LISTED,
    NAMES_HEADERS,
    copy_block,
    first_value,
    has_header,
    header_map,
    header_values,
    name_table,
    origin_form,
    reason_phrase,
    relay_block,
    scan_request,
    token_set,
)
from sidecar.engine.idle_poll import IdlePoller, window_seconds
from sidecar.engine.parsers import CallbackError, HeadTooLarge, ParseError, RequestParser, UpgradeRequest
from sidecar.context import TurnOutcome
from sidecar.router import BodyWork, Decision, RequestHead, Router, body_pool
from sidecar.state import LoadNeeded

log = logging.getLogger("sidecar.engine")

# An idle keep-alive client connection is closed after this long (nginx's default).
KEEPALIVE_TIMEOUT = 75.0
# After answering a request whose body was not read, keep reading (and discarding) for this long
# before closing, so the client sees the answer instead of a reset.
LINGER_SECONDS = 2.0
# Request body bytes held while no upstream connection is attached yet before reading pauses.
WAIT_BUFFER = 64 * 1024
# A buffered body larger than this goes to the transport in a write of its own.
_SEPARATE_WRITE = 256 * 1024

_INF = float("inf")

# Header names as lower-case str keys (the keys of the router's header dict).
_CONNECTION = h.CONNECTION.lower()
_CONTENT_LENGTH = h.CONTENT_LENGTH.lower()
_TRANSFER_ENCODING = h.TRANSFER_ENCODING.lower()
_EXPECT = h.EXPECT.lower()
_UPGRADE = h.UPGRADE.lower()
_XFF = h.X_FORWARDED_FOR.lower()
_XFP = h.X_FORWARDED_PROTO.lower()
_HOP = frozenset(n.lower() for n in h.HOP_BY_HOP)
# Never copied from the client: hop-by-hop fields, and the fields the engine writes itself from
# what it parsed (Host, the framing: Content-Length / Transfer-Encoding), so that no header
# filter (Connection tokens, a mode's strip list) can ever remove or change a message's framing.
_REQ_DROP = _HOP | {h.HOST.lower(), _CONTENT_LENGTH, _EXPECT, _XFF}
_CONNECTION_B = _CONNECTION.encode()
_TRANSFER_ENCODING_B = _TRANSFER_ENCODING.encode()
_EXPECT_B = _EXPECT.encode()
_UPGRADE_B = _UPGRADE.encode()
_XFF_B = _XFF.encode()
_XFP_B = _XFP.encode()
_HOST_FACTS = HOST_SEEN | HOST_REPEATED | HOST_INVALID
# Request headers whose presence takes the head checks and the forwarding off the fast path.
_SPECIAL = name_table(frozenset({_CONNECTION, _TRANSFER_ENCODING, _EXPECT, _UPGRADE, _XFF, _XFP}))

_XFF_LINE = h.X_FORWARDED_FOR.encode() + b": "
_XFP_LINE = h.X_FORWARDED_PROTO.encode() + b": http\r\n"
_CL_LINE = h.CONTENT_LENGTH.encode() + b": "
_CL_ZERO = _CL_LINE + b"0\r\n"
_CHUNKED_LINE = h.TRANSFER_ENCODING.encode() + b": chunked\r\n"
_CLOSE_LINE = h.CONNECTION.encode() + b": close\r\n"
_KEEPALIVE_LINE = h.CONNECTION.encode() + b": keep-alive\r\n"
_JSON_HEAD = h.CONTENT_TYPE.encode() + b": application/json\r\n" + _CL_LINE
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
_HTTP11 = b"HTTP/1.1 "
_HTTP10 = b"HTTP/1.0 "
# Methods for which the aiohttp client sends no ``Content-Length: 0`` on an empty body (parity).
_NO_EMPTY_LENGTH = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE"})
_METHODS = {m.encode(): m for m in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")}
_STATUS_CODE = {s.value: b"%d" % s.value for s in HTTPStatus}
_STATUS_LINE = {s.value: b"%d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}
# Mode header name -> (lower-case key, b"Name: ", lower-case bytes); names come from the modes: a handful.
_ADD_NAMES: dict[str, tuple[str, bytes, bytes]] = {}

# Exchange states. LOADING: its session is being loaded from the shared store (sidecar.state)
# before routing; TRANSFORMING: the router's body work runs on a worker thread.
QUEUED, LOADING, BUFFERING, TRANSFORMING, CONNECTING, SENDING, SENT, DONE = range(8)
# How the response body is framed towards the client.
R_NONE, R_LENGTH, R_CHUNKED, R_CLOSE = range(4)
_RELAY = {R_NONE: RELAY_NONE, R_LENGTH: RELAY_RAW, R_CHUNKED: RELAY_CHUNKED, R_CLOSE: RELAY_RAW}
# The outcomes of every response, as module constants: an Enum member read from its class goes
# through EnumType.__getattr__ (hundreds of instructions per read).
_COMPLETED = TurnOutcome.COMPLETED
_UPSTREAM_FAILED = TurnOutcome.UPSTREAM_FAILED


def _add_name(name: str) -> tuple[str, bytes, bytes]:
    entry = (name.lower(), name.encode("latin-1") + b": ", name.lower().encode("latin-1"))
    if len(_ADD_NAMES) < 256:
        _ADD_NAMES[name] = entry
    return entry


class _Shared:
    """What every connection of one engine reads or updates per request, in one typed object
    (compiled, a struct: FastEngine itself is a Python class, whose attributes cost a lookup each)."""

    __slots__ = ("router", "upstreams", "drops", "gauge", "health", "in_flight", "draining", "drained", "poller")

    def __init__(self, router: Router, gauge: Any, health: Any) -> None:
        self.router = router
        # Upstream.pool_key -> (pool, b" " + base path, b" HTTP/1.1\r\nHost: ...\r\n")
        self.upstreams: dict[str, tuple[UpstreamPool, bytes, bytes]] = {}
        self.drops: dict[frozenset[str], frozenset[str]] = {}
        self.gauge = gauge  # the in-flight gauge's child, set from ``in_flight`` (no call per request)
        self.health = health
        self.in_flight = 0
        self.draining = False
        self.drained: asyncio.Future[None] | None = None  # set while a drain waits for in_flight == 0
        self.poller: IdlePoller | None = None  # set by start(); told of every read

    def request_done(self) -> None:
        """A request left the engine (answered, refused or abandoned)."""
        self.in_flight -= 1
        self.gauge.value = self.in_flight
        drained = self.drained
        if drained is not None and self.in_flight == 0 and not drained.done():
            drained.set_result(None)


class FastEngine(Engine):
    """Reverse proxy on asyncio Protocols (uvloop in production) with llhttp parsing."""

    compiled = is_compiled(sys.modules[__name__])

    _server: asyncio.AbstractServer
    _port: int
    loop: asyncio.AbstractEventLoop

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.clients: set[_ClientConnection] = set()
        self.shared = _Shared(self.router, self.metrics.in_flight.labels(), self.health)
        self._pools: list[UpstreamPool] = []
        self.body_pool = body_pool()  # the router's BodyWork (large bodies)

    async def start(self) -> None:
        self.loop = loop = asyncio.get_running_loop()
        window = window_seconds(self.config.idle_poll_us)
        if not window and self.config.idle_poll_us is None:
            log.info("idle polling off: the container's CPU quota is below one CPU (idle_poll_us overrides)")
        self.shared.poller = poller = IdlePoller(loop, window)
        self.metrics.watch_poller(poller)
        # One pool per upstream address and TLS context (one per deployment: deployments with
        # other TLS settings never share a connection), bounded by the largest limits of the
        # deployments using it.
        limits: dict[tuple[Any, ...], tuple[int, int]] = {}
        for dep in self.router.deployments:
            for up in dep.upstreams:
                key = (up.host, up.port, up.tls_context)
                conns, head = limits.get(key, (0, 0))
                limits[key] = (max(conns, dep.limits.max_connections_per_upstream),
                               max(head, dep.limits.max_header_bytes))
        pools: dict[tuple[Any, ...], UpstreamPool] = {}
        for dep in self.router.deployments:
            for up in dep.upstreams:
                key = (up.host, up.port, up.tls_context)
                if key not in pools:
                    pools[key] = UpstreamPool(loop, up.host, up.port, *limits[key], poller, up.tls_context,
                                              up.server_hostname)
                self.shared.upstreams[up.pool_key] = (pools[key], b" " + up.base_path.encode(),
                                          f" HTTP/1.1\r\n{h.HOST}: {up.host_header}\r\n".encode())
        self._pools = list(pools.values())
        listen = self.config.listen
        self._server = await loop.create_server(lambda: _ClientConnection(self), listen.host, listen.port,
                                                backlog=1024, reuse_address=True)
        self._port = int(self._server.sockets[0].getsockname()[1])

    @property
    def port(self) -> int:
        return self._port

    @property
    def in_flight(self) -> int:
        return self.shared.in_flight

    @property
    def draining(self) -> bool:
        return self.shared.draining

    def stop_keepalive(self) -> None:
        # ``draining`` makes every answer close its connection; the listener stays open until drain().
        self.shared.draining = True

    async def drain(self, grace: float) -> None:
        shared = self.shared
        shared.draining = True
        self._server.close()
        for client in list(self.clients):
            if not client.queue:
                client.close()
        if shared.in_flight:
            shared.drained = drained = self.loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(drained), grace)
            except asyncio.TimeoutError:
                log.warning("drain grace expired with %d requests in flight", shared.in_flight)

    async def close(self) -> None:
        if self.shared.poller is not None:
            self.shared.poller.stop()
        self._server.close()
        for client in list(self.clients):
            client.abort_all()
        for pool in self._pools:
            pool.close()
        self.body_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.sleep(0)  # let the transports' connection_lost callbacks run

    def stats(self) -> dict[str, int]:
        """Connection and buffer counts right now (diagnostics; tests check buffers stay bounded)."""
        up_buffered = 0
        for client in self.clients:
            for ex in client.queue:
                if ex.conn is not None and ex.conn.transport is not None:
                    up_buffered += ex.conn.transport.get_write_buffer_size()
        return {
            "clients": len(self.clients),
            "in_flight": self.shared.in_flight,
            "client_write_buffer": sum(c.transport.get_write_buffer_size() for c in self.clients),
            "upstream_write_buffer": up_buffered,
            "upstream_connections": sum(p.total for p in self._pools),
            "upstream_idle": sum(len(p.idle) for p in self._pools),
        }

    # -- used by connections and exchanges ------------------------------------------------

    def drop_for(self, strip: frozenset[str]) -> frozenset[str]:
        """Request headers never forwarded for a decision's ``strip`` (cached: one per deployment)."""
        drop = _REQ_DROP | {s.lower() for s in strip}
        drops = self.shared.drops
        if len(drops) < 64:
            drops[strip] = drop
        return drop


class _ClientConnection:
    """One client connection: parses requests, answers them in order (an asyncio protocol by
    duck typing: compiled, it is an extension type, which cannot derive from ``asyncio.Protocol``)."""

    __slots__ = ("engine", "shared", "loop", "parser", "transport", "flow", "peer", "xff_xfp", "queue", "cur",
                 "out", "max_head", "stopped", "write_paused", "idle_since", "timer", "timer_due", "closing",
                 "advancing", "head_since", "head_timeout")

    def __init__(self, engine: FastEngine) -> None:
        self.engine = engine
        self.shared = engine.shared
        self.loop = engine.loop
        self.max_head = engine.config.limits.max_header_bytes
        self.parser = RequestParser(self, self.max_head)
        self.queue: deque[_Exchange] = deque()
        self.cur: _Exchange | None = None  # the request whose body is being parsed
        self.out: list[bytes] = []  # bytes for the client, written once per event
        self.stopped = False
        self.write_paused = False
        self.closing = False
        self.advancing = False
        self.timer: asyncio.TimerHandle | None = None  # the watchdog (see _watch)
        self.timer_due = _INF  # when it fires (perf_counter time)
        self.head_since = 0.0  # when the head in progress began (0: none)
        self.head_timeout = engine.config.head_timeout_seconds

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.flow = ReadFlow(transport)
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]).encode() if peer else b""
        # What a request without X-Forwarded-* headers gets: built once per connection.
        self.xff_xfp = _XFF_LINE + self.peer + b"\r\n" + _XFP_LINE
        self.engine.clients.add(self)
        self.idle_since = now = perf_counter()
        self._arm(now + KEEPALIVE_TIMEOUT, now)

    def data_received(self, data: bytes) -> None:
        self.shared.poller.note()
        if self.stopped:
            return
        try:
            self.parser.feed_data(data)
        except UpgradeRequest:
            self._stop()  # the upgrade/CONNECT request is queued and refused; nothing after it is read
        except HeadTooLarge:
            self._refuse(errors.headers_too_large(self.max_head), "headers_too_large")
        except ParseError as exc:
            if isinstance(exc, CallbackError):
                log.error("request parser callback failed", exc_info=exc.__cause__)
            self._refuse(errors.bad_request(f"malformed request: {exc}"), "bad_request")
        if self.parser.in_head:  # a head is in progress: it must complete in time (see _watch)
            if not self.head_since:
                now = perf_counter()
                self.head_since = now
                due = now + self.head_timeout
                if due < self.timer_due:
                    self._arm(due, now)
        elif self.head_since:
            self.head_since = 0.0
        if self.queue:
            self.advance()
        elif self.out:
            self.flush()

    def eof_received(self) -> bool | None:
        return None  # the client is gone: close (connection_lost aborts what is in flight)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.stopped = True
        self.engine.clients.discard(self)
        self._disarm()
        queue = self.queue
        while queue:
            queue.popleft().client_gone()

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.queue:
            conn = self.queue[0].conn
            if conn is not None:
                conn.flow.pause(CLIENT_FULL)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.queue:
            conn = self.queue[0].conn
            if conn is not None:
                conn.flow.resume(CLIENT_FULL)

    # -- parser callbacks (see sidecar.engine.parsers) --------------------------------

    def on_head(self, raw: bytes, first: int, end: int, method: bytes, target: bytes, version: int,
                keep_alive: bool, length: int) -> None:
        self.cur = ex = _Exchange(self)
        ex.raw = raw
        ex.first = first
        ex.end = end
        ex.method = method
        ex.target = target
        ex.keep_alive = keep_alive
        ex.length = length
        facts = scan_request(raw, first, end, _SPECIAL)
        ex.special = special = facts & LISTED != 0
        # Without a Connection header (``special`` covers it), llhttp keeps a request alive only
        # for HTTP/1.1 (major and minor both > 0; it rejects versions other than 0.9, 1.0, 1.1
        # and 2.0): the common case (one valid Host, origin-form) needs no further check.
        if not keep_alive or special or facts & _HOST_FACTS != HOST_SEEN or target[:1] != b"/" \
                or method == b"CONNECT":
            ex.check_head(version, facts)
        ex.queued = True
        queue = self.queue
        waits = bool(queue)  # an earlier request is still in progress
        queue.append(ex)
        if ex.error is not None:
            self._stop()  # answered, then closed: later bytes are never read as requests
        elif waits:
            self.flow.pause(PIPELINED)

    def on_body(self, body: bytes) -> None:
        ex = self.cur
        assert ex is not None
        if ex.state != DONE:
            ex.body.append(body)
            ex.body_size += len(body)

    def on_message_complete(self) -> None:
        ex = self.cur
        assert ex is not None
        ex.complete = True
        self.cur = None

    # -- request queue --------------------------------------------------------------------

    def advance(self) -> None:
        """Start the oldest request if it is not started, move its body along, write output."""
        if not self.advancing and not self.closing:
            self.advancing = True
            queue = self.queue
            try:
                while queue:
                    ex = queue[0]
                    if ex.state != QUEUED:
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
        if self.out:
            self.flush()

    def done(self, ex: _Exchange) -> None:
        """``ex`` is answered (or abandoned by us): move on to the next request or close."""
        queue = self.queue
        if queue and queue[0] is ex:
            queue.popleft()
        self.shared.request_done()
        if ex.close_after or self.shared.draining:
            self.close()
            return
        if not queue:
            self.idle_since = perf_counter()
        self.advance()

    def flush(self) -> None:
        out = self.out
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            if not self.closing:
                self.transport.write(data)

    def close(self) -> None:
        """Close after what was written; linger when unread request bytes may still arrive."""
        if self.closing:
            return
        self.flush()
        self.closing = True
        self._disarm()
        self.queue.clear()  # pipelined requests never started: the client retries them elsewhere
        transport = self.transport
        if self.cur is None and not self.stopped:
            transport.close()
            return
        # Closing with unread bytes in the socket makes the kernel send a reset that can destroy
        # the answer in flight: half-close, discard what still comes, then close.
        self.stopped = True
        self.flow.clear()
        try:
            transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            transport.abort()
            return
        self.loop.call_later(LINGER_SECONDS, transport.abort)

    def abort(self) -> None:
        """Drop the connection now, discarding unsent output (an incomplete response stays incomplete)."""
        self.out.clear()
        self.closing = True
        self.stopped = True
        self._disarm()
        self.transport.abort()

    def abort_all(self) -> None:
        queue = self.queue
        while queue:
            queue.popleft().client_gone()
        self.abort()

    def _stop(self) -> None:
        self.stopped = True
        self.flow.pause(STOPPED)

    def _refuse(self, exc: errors.ProxyError, reason: str) -> None:
        """The request stream is unusable from here: answer the offending request, read no more."""
        self._stop()
        ex = self.cur
        self.cur = None
        if ex is None or not ex.queued:
            ex = _Exchange(self)
            ex.error = (exc, reason)
            ex.queued = True
            self.queue.append(ex)
        elif ex.state == QUEUED:
            ex.error = (exc, reason)  # its head was fine, its body was not: never forward it
        else:
            ex.refused(exc, reason)

    # -- the watchdog: keep-alive, head, first-byte and idle timeouts ---------------------------
    # One timer per connection, always armed while it is open, firing no later than the earliest
    # deadline: the keep-alive or head timeout when no request is in progress, else the deadline
    # of the request at the head of the queue (its body's arrival, the upstream's first byte or
    # the silence between chunks). Requests only re-arm it when their
    # deadline is earlier than the armed one (on a busy connection: almost never); when it fires
    # early it re-arms for the deadline that applies then.

    def _arm(self, due: float, now: float) -> None:
        """Fire the watchdog at ``due`` (capped at one keep-alive period from ``now``)."""
        timer = self.timer
        if timer is not None:
            timer.cancel()
        cap = now + KEEPALIVE_TIMEOUT  # the request may end any time: the connection then idles
        if due > cap:
            due = cap
        self.timer_due = due
        self.timer = self.loop.call_later(due - now if due > now else 0.0, self._watch)

    def _disarm(self) -> None:
        timer = self.timer
        if timer is not None:
            timer.cancel()
            self.timer = None
        self.timer_due = _INF

    def _watch(self) -> None:
        self.timer = None
        self.timer_due = _INF
        if self.closing:
            return
        now = perf_counter()
        queue = self.queue
        if not queue:
            head_since = self.head_since
            if head_since and now - head_since >= self.head_timeout:
                self.head_since = 0.0
                self._refuse(errors.request_timeout(
                    f"the request head did not arrive within {self.head_timeout:g} s"), errors.REQUEST_TIMEOUT)
                self.advance()
                return
            if now - self.idle_since >= KEEPALIVE_TIMEOUT:
                self.close()
                return
            due = self.idle_since + KEEPALIVE_TIMEOUT
            if head_since and head_since + self.head_timeout < due:
                due = head_since + self.head_timeout
            self._arm(due, now)
            return
        ex = queue[0]
        if ex.deadline() <= now:
            ex.timed_out(now)
            self.flush()
            if self.closing or self.timer is not None:
                return
            now = perf_counter()
            if not queue:
                self._arm(self.idle_since + KEEPALIVE_TIMEOUT, now)
                return
            ex = queue[0]
        self._arm(ex.deadline(), now)


class _Exchange:
    """One request/response: routed, forwarded, relayed, finished exactly once."""

    __slots__ = ("client", "method", "target", "raw", "first", "end", "special", "http10", "keep_alive", "length",
                 "chunked", "expect", "conn_tokens", "error", "queued", "body", "body_size", "complete",
                 "state", "started", "decision", "t0", "limit", "head", "frame_chunked", "conn",
                 "connect_timeout", "first_byte_timeout", "idle_timeout", "last_io", "request_sent",
                 "resp_started", "resp_status", "resp_mode", "resp_head", "head_at", "close_after")

    def __init__(self, client: _ClientConnection) -> None:
        self.client = client
        self.method = b""
        self.target = b""
        # The header block, raw[first:end] (sidecar.engine.head): read by the router through a
        # HeaderBlock view, forwarded as slices of the lines it keeps.
        self.raw = b""
        self.first = 0
        self.end = 0
        self.special = False  # a header in _SPECIAL is present: take the slow head checks
        self.http10 = False
        self.keep_alive = False
        self.length = -1  # declared Content-Length
        self.chunked = False
        self.expect = False
        self.conn_tokens: set[str] | frozenset[str] = frozenset()
        self.error: tuple[errors.ProxyError, str] | None = None  # answered locally instead
        self.queued = False
        self.body: list[bytes] = []  # parsed body bytes not yet forwarded
        self.body_size = 0
        self.complete = False  # the whole request was parsed
        self.state = QUEUED
        self.started = False
        self.decision: Decision | None = None
        self.t0 = 0.0
        self.limit = 0
        self.head: list[bytes] = []  # the upstream request's pieces while no connection is attached
        self.frame_chunked = False
        self.conn: UpstreamConnection | None = None
        self.connect_timeout = 0.0
        self.first_byte_timeout = 0.0
        self.idle_timeout = 0.0
        self.last_io = 0.0
        self.request_sent = False
        self.resp_started = False
        self.resp_status = 0
        self.resp_mode = R_NONE
        # The parsed response head until the router heard of it (see _observe_head).
        self.resp_head: Mapping[str, str] | None = None
        self.head_at = 0.0
        self.close_after = False

    # -- request head -------------------------------------------------------------------------

    def check_head(self, version: int, facts: int) -> None:
        """Framing and form checks llhttp leaves to the application (run at end of head), for
        heads off the fast path (HTTP/1.0, framing or forwarding headers, Host issues, odd
        targets). ``version`` is ``10 * major + minor``; ``facts`` are the head's
        :func:`~sidecar.engine.head.scan_request` bits."""
        raw, first, end = self.raw, self.first, self.end
        self.http10 = version == 10
        if version != 11 and not self.http10:
            self.error = (errors.bad_request(f"unsupported HTTP version {version // 10}.{version % 10}"), "bad_request")
            return
        # RFC 9112 3.2: one valid Host, required in HTTP/1.1.
        if facts & HOST_REPEATED or facts & HOST_INVALID or not (facts & HOST_SEEN or self.http10):
            problem = "more than one Host header" if facts & HOST_REPEATED else \
                "invalid Host header (uri-host[:port] expected)" if facts & HOST_INVALID else \
                "missing Host header (required in HTTP/1.1)"
            self.error = (errors.bad_request(problem), "bad_request")
            return
        connection = header_values(raw, first, end, _CONNECTION_B, False)
        if connection:
            self.conn_tokens = token_set(connection)
        te = header_values(raw, first, end, _TRANSFER_ENCODING_B, False)
        if te:
            if self.http10 or len(te) > 1 or te[0].strip().lower() != b"chunked":
                self.error = (errors.bad_request("unsupported Transfer-Encoding (only chunked, on HTTP/1.1)"),
                              "bad_request")
                return
            self.chunked = True
        if "upgrade" in self.conn_tokens and has_header(raw, first, end, _UPGRADE_B):
            self.error = (errors.upgrade_not_supported(), "upgrade")
            return
        if self.method != b"CONNECT" and not self.target.startswith(b"/"):
            origin = origin_form(self.target)  # absolute-form: forwarded in origin-form
            if origin is not None:
                self.target = origin
        if self.method == b"CONNECT" or not self.target.startswith(b"/"):
            self.error = (errors.bad_request("request target must be origin-form (/path) or absolute-form "
                                             "(http://host/path)"), "bad_request")
            return
        expect = first_value(raw, first, end, _EXPECT_B)
        self.expect = expect is not None and expect.lower() == b"100-continue"

    # -- request path -------------------------------------------------------------------------

    def start(self) -> None:
        """Route the request at the head of the queue; forward it unless answered here."""
        client = self.client
        shared = client.shared
        self.started = True
        self.state = BUFFERING
        shared.in_flight += 1
        shared.gauge.value = shared.in_flight
        router = shared.router
        if self.error is not None:
            exc, reason = self.error
            self.respond_error(exc, router.default.name, router.default.mode_name, reason, close=True)
            return
        self.t0 = perf_counter()
        self._route(False)

    def _route(self, loaded: bool) -> None:
        """Route the started request (``loaded``: its session was just loaded from the shared
        store) and forward it, or answer it here."""
        client = self.client
        router = client.shared.router
        method = self.method
        try:
            decision = router.route(RequestHead(_METHODS[method] if method in _METHODS else method.decode("latin-1"),
                                                self.target.decode("utf-8", "surrogateescape"),
                                                header_map(self.raw, self.first, self.end)), loaded)
        except errors.ProxyError as exc:
            self.respond_error(exc, router.default.name, router.default.mode_name, exc.type)
            return
        except LoadNeeded as need:
            self._load(need.identity)
            return
        self.decision = decision
        self.limit = limit = decision.max_body_bytes
        if self.length > limit or self.body_size > limit:
            dep = decision.deployment
            router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
            # A declared length whose body is already parsed leaves nothing to skip: keep the
            # connection. A chunked body over the limit, or one still arriving, ends it.
            exc = errors.request_too_large(dep.name, limit, decision.needs_body)
            self.respond_error(exc, dep.name, dep.mode_name, "body_too_large", close=self.chunked or not self.complete)
            return
        if self.expect and not self.complete and not self.http10:
            client.out.append(_CONTINUE)
        if decision.needs_body:
            if self.complete:
                self._send_transformed()
            else:
                self._await_body(decision)
            return
        self._forward(decision, -1)

    def _load(self, identity: Any, resume: Any = None) -> None:
        """Load the request's session from the shared store (a rare path: the first request of a
        session this replica does not hold), then route again, or with ``resume`` continue the
        admission of a body that named it. Body bytes keep arriving meanwhile (buffered as while
        connecting)."""
        self.state = LOADING
        client = self.client
        task = client.loop.create_task(client.shared.router.state.load(identity))
        task.add_done_callback(partial(self._loaded, resume))

    def _loaded(self, resume: Any, task: asyncio.Task[None]) -> None:
        if self.state != LOADING:  # the client left meanwhile
            return
        self.state = BUFFERING
        client = self.client
        if client.flow.reasons & WAITING:
            client.flow.resume(WAITING)  # routed now: reading goes on as the decision says
        try:
            if resume is None:
                self._route(True)
            else:
                self._body_ready(resume())
        except LoadNeeded as need:  # (never twice: the router was told the store was asked)
            self._body_failed(RuntimeError(f"session still not loaded: {need}"))
        except Exception as exc:  # a bug must cost one request, not the connection
            if resume is None:
                log.error("request failed in the engine: %r", exc, exc_info=exc)
                self.internal_error()
            else:
                self._body_failed(exc)
        client.flush()

    def _await_body(self, decision: Decision) -> None:
        """The body a mode reads is still arriving: bound its arrival like a response's (the
        deployment's first-byte timeout for all of it, its idle timeout between reads)."""
        t = decision.deployment.timeouts
        self.first_byte_timeout = t.first_byte
        self.idle_timeout = t.idle
        self.last_io = now = self.t0
        due = self.deadline()
        client = self.client
        if due < client.timer_due:
            client._arm(due, now)

    def _forward(self, decision: Decision, length: int) -> None:
        """Build the upstream request head and send it with the body parsed so far on a pooled
        connection (or wait for one). ``length >= 0`` replaces the body framing (transformed body).

        Flattened (head building, metrics, connection pick and attach in one method): it runs
        once per forwarded request."""
        client = self.client
        shared = client.shared
        pool, base, version_host = shared.upstreams[decision.upstream.pool_key]
        raw = self.raw
        strip = decision.drop
        drops = shared.drops
        drop = drops[strip] if strip in drops else client.engine.drop_for(strip)
        if self.conn_tokens:
            drop = drop | self.conn_tokens
        add = decision.add
        if add:
            for name, _ in add:
                entry = _ADD_NAMES[name] if name in _ADD_NAMES else _add_name(name)
                key = entry[0]
                if key not in drop and has_header(raw, self.first, self.end, entry[2]):
                    drop = drop | {key}  # the mode's value replaces a client header of the same name
        parts = [self.method, base, self.target, version_host]
        copy_block(raw, self.first, self.end, parts, name_table(drop))
        if self.special:
            self._forwarded_for(parts, drop, strip)
        else:
            parts.append(client.xff_xfp)
        for name, value in add:
            parts += ((_ADD_NAMES[name] if name in _ADD_NAMES else _add_name(name))[1],
                      value.encode("utf-8", "surrogateescape"), b"\r\n")
        # The framing, from what the parser found (never from the client's header lines).
        if length >= 0:
            parts += (_CL_LINE, b"%d" % length, b"\r\n\r\n")
        elif self.chunked:
            parts += (_CHUNKED_LINE, b"\r\n")
            self.frame_chunked = True
        elif self.length >= 0:
            parts += (_CL_LINE, b"%d" % self.length, b"\r\n\r\n")
        elif self.method not in _NO_EMPTY_LENGTH:
            parts += (_CL_ZERO, b"\r\n")
        else:
            parts.append(b"\r\n")

        dep = decision.deployment
        t = dep.timeouts
        now = perf_counter()
        stats = dep.stats
        stats.added.observe(now - self.t0)  # type: ignore[union-attr]
        self.state = CONNECTING
        self.connect_timeout = t.connect
        self.idle_timeout = idle = t.idle
        # Like the aiohttp client's sock_read, silence before the head is bounded by `idle` too.
        first_byte = t.first_byte
        self.first_byte_timeout = first_byte = idle if idle < first_byte else first_byte
        due = self.t0 + first_byte
        if due < client.timer_due:
            client._arm(due, now)

        # Flattened pool.take for the usual case: the most recently used idle connection, back
        # from its last response too recently to need the stale-connection poll.
        idle = pool.idle
        conn = None
        if idle:
            conn = idle[-1]
            if not conn.lost and now - conn.idle_since < STALE_CHECK_AFTER and \
                    not conn.transport.is_closing():  # type: ignore[union-attr]
                idle.pop()
            else:
                conn = pool.take(now)
        if conn is None:
            self.head = parts
            pool.acquire(self)
            if self.state == CONNECTING and self.body_size > WAIT_BUFFER and not self.complete:
                client.flow.pause(WAITING)
            return
        # Flattened attach.
        self.conn = conn
        conn.ex = self
        if client.write_paused:
            conn.flow.pause(CLIENT_FULL)
        if conn.write_paused:
            client.flow.pause(PEER_FULL)
        self._send(conn, parts)

    def _forwarded_for(self, parts: list[bytes], drop: frozenset[str] | set[str], strip: frozenset[str]) -> None:
        """X-Forwarded-For / -Proto when the client sent forwarding headers of its own."""
        client = self.client
        raw, first, end = self.raw, self.first, self.end
        xff = b""
        if _XFF not in self.conn_tokens and _XFF not in strip:
            xff = b", ".join(header_values(raw, first, end, _XFF_B, False))
        parts += (_XFF_LINE, xff + b", " + client.peer if xff else client.peer, b"\r\n")
        if _XFP in drop or not has_header(raw, first, end, _XFP_B):
            parts.append(_XFP_LINE)

    def pump(self) -> None:
        """Client bytes were parsed: forward, buffer or refuse them according to the state."""
        state = self.state
        if state >= SENT:
            return
        if state == LOADING:  # not routed yet: buffer, as while waiting for a connection
            if self.body_size > WAIT_BUFFER and not self.complete:
                self.client.flow.pause(WAITING)
            return
        if self.body_size > self.limit:
            self._too_large_midway()
        elif state == SENDING:
            out: list[bytes] = []
            if self.body:
                self._frame_body(out)
            if self.complete:
                if self.frame_chunked:
                    out.append(_LAST_CHUNK)
                self.state = SENT
                self.request_sent = True
            if out:
                assert self.conn is not None and self.conn.transport is not None
                self.conn.transport.write(b"".join(out))
                self.last_io = perf_counter()
        elif state == BUFFERING:
            if self.complete:
                self._send_transformed()
            else:
                self.last_io = perf_counter()  # body bytes arrived (see deadline)
        elif state == CONNECTING and self.body_size > WAIT_BUFFER and not self.complete:
            self.client.flow.pause(WAITING)

    def _send_transformed(self) -> None:
        """The whole body of a ``needs_body`` request is here: the router reads (or rewrites) it,
        then it is forwarded. Any failure finishes the turn and answers a JSON error."""
        body = self.body
        raw = body[0] if len(body) == 1 else list(body)  # a large body is joined off the loop
        body.clear()
        try:
            self._body_ready(self.client.shared.router.transform_body(self.decision, raw, self.body_size))
        except LoadNeeded as need:
            self._load(need.identity, need.resume)
        except Exception as exc:
            self._body_failed(exc)

    def _body_ready(self, result: Decision | BodyWork) -> None:
        """Forward what the router's complete decision says (it replaces the provisional one),
        or run its body work (a large body) on a worker thread: a future whose callback comes
        back here, on the loop."""
        if type(result) is not BodyWork:
            self.decision = result
            body = result.body
            assert body is not None
            if body:
                self.body.append(body)
            self._forward(result, len(body))
            return
        self.state = TRANSFORMING
        engine = self.client.engine
        future = engine.loop.run_in_executor(engine.body_pool, result.run)
        future.add_done_callback(partial(self._work_done, result))

    def _work_done(self, work: BodyWork, future: asyncio.Future[Any]) -> None:
        if self.state != TRANSFORMING:  # the client left meanwhile
            if not future.cancelled():
                future.exception()  # retrieved: nothing left to report
            work.abandon(TurnOutcome.CLIENT_ABORTED)
            return
        try:
            if future.cancelled():
                raise RuntimeError("body work cancelled (the engine is closing)")
            done = future.result()
        except Exception as exc:  # a defect in the work
            work.abandon(TurnOutcome.UPSTREAM_FAILED)
            self._body_failed(exc)
            self.client.flush()
            return
        try:
            self._body_ready(work.resume(done))
        except LoadNeeded as need:
            self._load(need.identity, need.resume)
        except Exception as exc:
            self._body_failed(exc)
        self.client.flush()

    def _body_failed(self, exc: Exception) -> None:
        """Finish the turn and answer: the router's JSON error, or 500 for a defect."""
        if self.state == DONE:
            return
        decision = self.decision
        assert decision is not None
        if isinstance(exc, errors.ProxyError):
            self.client.shared.router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
            dep = decision.deployment
            self.respond_error(exc, dep.name, dep.mode_name, exc.type)
            return
        log.error("request body handling failed: %r", exc, exc_info=exc, extra=decision.log_fields())
        self.internal_error()

    def _frame_body(self, out: list[bytes]) -> None:
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        if not data:
            return
        if self.frame_chunked:
            out += (b"%x\r\n" % len(data), data, b"\r\n")
        else:
            out.append(data)

    # -- used by the pool and the upstream connection ---------------------------------------

    @property
    def wants_connection(self) -> bool:
        return self.state == CONNECTING

    def attach(self, conn: UpstreamConnection) -> None:
        """A connection for a request that waited for one (opened, or freed by another)."""
        self.conn = conn
        client = self.client
        conn.bind(self, client.write_paused)
        if client.flow.reasons & WAITING:
            client.flow.resume(WAITING)
        out = self.head
        self.head = []
        self._send(conn, out)

    def _send(self, conn: UpstreamConnection, parts: list[bytes]) -> None:
        """Write the request head in ``parts`` with the body received so far in one write; the
        request is SENT when it is complete, else SENDING (the rest streams as it arrives)."""
        body = self.body
        large = None
        if body:
            if self.frame_chunked:
                self._frame_body(parts)
            elif len(body) == 1 and len(body[0]) > _SEPARATE_WRITE:
                large = body.pop()  # a buffered body: written by itself, not copied into the head's write
            else:
                parts += body
                body.clear()
        if self.complete:
            if self.frame_chunked:
                parts.append(_LAST_CHUNK)
            self.state = SENT
            self.request_sent = True
        else:
            self.state = SENDING
        assert conn.transport is not None
        conn.transport.write(b"".join(parts))
        if large is not None:
            conn.transport.write(large)

    def connect_failed(self, kind: str, exc: BaseException) -> None:
        if self.state != CONNECTING:
            # ``tls``: the upstream refused the TLS session after the request was written to it
            # (it never reached the application); nothing to do once a response began.
            if kind != "tls" or self.state == DONE or self.resp_started:
                return
            self.conn = None
        decision = self.decision
        assert decision is not None
        dep, up = decision.deployment, decision.upstream
        engine = self.client.engine
        if kind == "timeout":
            engine.upstream_failure(dep, up, "timeout", "connect timed out", connecting=True)
            self._upstream_error("timeout", errors.upstream_timeout(dep.name, up.index))
        else:
            reason = failure_reason(exc)
            engine.upstream_failure(dep, up, "connect", reason, connecting=True)
            self.client.shared.router.upstream_unreachable(decision)  # nothing was sent: fail the tree over
            self._upstream_error("connect", errors.upstream_unreachable(dep.name, up.index, reason))

    def peer_full(self, full: bool) -> None:
        if full:
            self.client.flow.pause(PEER_FULL)
        else:
            self.client.flow.resume(PEER_FULL)

    def response_head(self, status: int, raw: bytes, start: int, first: int, end: int, now: float) -> int:
        """The upstream's response head (status line at ``raw[start:first]``, header block
        ``raw[first:end]``): queue the client's head, set up the relay of the body (flattened:
        once per request; the router hears of the head in :meth:`_observe_head`)."""
        client = self.client
        self.resp_status = status
        self.resp_started = True
        self.last_io = now
        # The router and the metrics hear of the head once its bytes are written (_observe_head):
        # off the latency path, still before anything can finish the turn.
        self.resp_head = header_map(raw, first, end)
        self.head_at = now
        out = client.out
        out += (_HTTP10 if self.http10 else _HTTP11,
                _STATUS_CODE[status] if status in _STATUS_CODE else b"%d" % status, b" ",
                reason_phrase(raw, start, first), b"\r\n")
        mark = len(out)
        framing = relay_block(raw, first, end, out, None)  # the header lines minus hop-by-hop ones
        if framing & NAMES_HEADERS:  # not the usual single "keep-alive" or "close"
            del out[mark:]
            relay_block(raw, first, end, out, token_set(header_values(raw, first, end, _CONNECTION_B, False)))
        body = BODY_FRAMED
        if self.method == b"HEAD":
            mode = R_NONE
            body = BODY_NONE
        elif status == 204 or status == 304:
            mode = R_NONE
        elif framing & (HAS_CONTENT_LENGTH | HAS_TRANSFER_ENCODING) == HAS_CONTENT_LENGTH:
            mode = R_LENGTH
        else:
            if framing & HAS_TRANSFER_ENCODING:
                codings = b",".join(header_values(raw, first, end, _TRANSFER_ENCODING_B, False))
                if codings.rsplit(b",", 1)[-1].strip().lower() != b"chunked":
                    body = BODY_UNTIL_EOF
            else:
                body = BODY_UNTIL_EOF
            mode = R_CLOSE if self.http10 else R_CHUNKED
        if mode == R_CHUNKED:
            out.append(_CHUNKED_LINE)
        if not (self.keep_alive and self.complete and mode != R_CLOSE and not client.shared.draining):
            if not self.http10:  # closing is HTTP/1.0's default
                out.append(_CLOSE_LINE)
            self.close_after = True
        elif self.http10:
            out.append(_KEEPALIVE_LINE)
        out.append(b"\r\n")
        self.resp_mode = mode
        conn = self.conn
        if conn is not None:
            conn.relay = _RELAY[mode] if body != BODY_NONE else RELAY_NONE
            conn.sink = out
        return body

    def flush(self) -> None:
        """Part of the response was relayed: write it."""
        self.client.flush()
        if self.resp_head is not None:
            self._observe_head()

    def _observe_head(self) -> None:
        """Tell the router and the metrics about the response head (once: right after its bytes
        were written, and in any case before the turn finishes)."""
        headers = self.resp_head
        assert headers is not None
        self.resp_head = None
        shared = self.client.shared
        decision = self.decision
        assert decision is not None
        health = shared.health
        if not health.settled:
            health.answered(decision.deployment, decision.upstream)
        stats = decision.deployment.stats
        stats.ttfb.observe(self.head_at - self.t0)  # type: ignore[union-attr]
        router = shared.router
        router.on_response(decision, self.resp_status, headers)

    def _finish_turn(self, outcome: TurnOutcome) -> None:
        """Finish the router's turn off the success path: after the response head it has not
        heard of yet, if any."""
        if self.resp_head is not None:
            self._observe_head()
        decision = self.decision
        assert decision is not None
        self.client.shared.router.finish(decision, outcome)

    def response_end(self, now: float) -> None:
        """The last response byte arrived: write it, count, finish the turn, move on
        (flattened: once per request)."""
        client = self.client
        out = client.out
        if self.resp_mode == R_CHUNKED:
            out.append(_LAST_CHUNK)
        # The last byte is on its way before the router hears the turn ended.
        if out:
            data = b"".join(out)
            out.clear()
            if not client.closing:
                client.transport.write(data)
        self.conn = None
        self.state = DONE
        if self.resp_head is not None:
            self._observe_head()
        shared = client.shared
        decision = self.decision
        assert decision is not None
        stats = decision.deployment.stats
        assert stats is not None
        status = self.resp_status
        stats.request(status).inc()
        stats.duration.observe(now - self.t0)
        router = shared.router
        router.finish(decision, _COMPLETED if status < 500 else _UPSTREAM_FAILED)
        # Flattened client.done(self).
        queue = client.queue
        if queue and queue[0] is self:
            queue.popleft()
        shared.request_done()
        if not self.complete or self.close_after or shared.draining:
            client.close()  # (an unread rest of the request body is never read)
            return
        if queue:
            client.advance()
        else:
            client.idle_since = now
            if client.flow.reasons & PIPELINED:
                client.flow.resume(PIPELINED)

    def upstream_failed(self, message: str) -> None:
        """The upstream connection failed (it has detached itself)."""
        self.conn = None
        if self.state == DONE:
            return
        decision = self.decision
        assert decision is not None
        dep, up = decision.deployment, decision.upstream
        if not self.resp_started:
            self.client.engine.upstream_failure(dep, up, "protocol", message)
            self._upstream_error("protocol", errors.upstream_protocol_error(dep.name, up.index, message))
            return
        self._fail_mid_response("reset", f"mid-response: {message}")

    # -- timeouts (see _ClientConnection._watch) ----------------------------------------------

    def deadline(self) -> float:
        """When this request times out as things stand (perf_counter time; inf: no timeout)."""
        state = self.state
        if state == BUFFERING and self.decision is not None and self.idle_timeout:
            body_due = self.last_io + self.idle_timeout
            whole = self.t0 + self.first_byte_timeout
            return body_due if body_due < whole else whole
        if state < CONNECTING or state == DONE:
            return _INF
        if not self.resp_started:
            return self.t0 + self.first_byte_timeout
        return self.last_io + self.idle_timeout

    def timed_out(self, now: float) -> None:
        decision = self.decision
        assert decision is not None
        dep, up = decision.deployment, decision.upstream
        if self.state == BUFFERING:  # the client stopped sending the body a mode reads
            self._finish_turn(TurnOutcome.CLIENT_ABORTED)
            self.respond_error(errors.request_timeout(f"the request body stalled (deployment {dep.name!r})"),
                               dep.name, dep.mode_name, errors.REQUEST_TIMEOUT, close=True)
            return
        if not self.resp_started:
            reason = f"no response within {self.first_byte_timeout:g} s"
            self.client.engine.upstream_failure(dep, up, "timeout", reason)
            self._upstream_error("timeout", errors.upstream_timeout(dep.name, up.index))
            return
        self._fail_mid_response("timeout", f"mid-response: idle for {self.idle_timeout:g} s")

    def _fail_mid_response(self, kind: str, message: str) -> None:
        """The upstream failed after the response head went out: the status line is gone, so the
        only honest signal left is an incomplete response (an aborted connection), not a clean end."""
        decision = self.decision
        assert decision is not None
        dep = decision.deployment
        engine = self.client.engine
        engine.metrics.upstream_error(dep.name, kind).inc()
        self._finish_turn(TurnOutcome.UPSTREAM_FAILED)
        engine.upstream_failure(dep, decision.upstream, kind, message)
        self._abort_client()

    # -- failures and local answers ---------------------------------------------------------

    def respond_error(self, exc: errors.ProxyError, dep_name: str, mode_name: str, reason: str | None,
                      close: bool = False) -> None:
        """Answer with the JSON error (the router's turn, if any, is already finished)."""
        client = self.client
        engine = client.engine
        engine.metrics.request_counter(dep_name, mode_name, f"{exc.status // 100}xx").inc()
        if reason:
            engine.metrics.rejected.labels(reason).inc()
        self._release_upstream()
        body = exc.body()
        keep = not close and self.keep_alive and self.complete and not client.shared.draining
        parts = [_HTTP10 if self.http10 else _HTTP11,
                 _STATUS_LINE.get(exc.status) or b"%d Error\r\n" % exc.status,
                 _JSON_HEAD, b"%d" % len(body), b"\r\n"]
        if not keep:
            if not self.http10:
                parts.append(_CLOSE_LINE)
        elif self.http10:
            parts.append(_KEEPALIVE_LINE)
        parts.append(b"\r\n")
        if self.method != b"HEAD":
            parts.append(body)
        client.out.append(b"".join(parts))
        self.close_after = not keep
        self.state = DONE
        client.done(self)

    def internal_error(self) -> None:
        if self.state == DONE:
            return
        if self.decision is not None:
            self._finish_turn(TurnOutcome.UPSTREAM_FAILED)
        d = self.client.shared.router.default
        exc = errors.internal_error()
        self.respond_error(exc, d.name, d.mode_name, None, close=True)

    def refused(self, exc: errors.ProxyError, reason: str) -> None:
        """The body of this started request turned out malformed: never complete it upstream."""
        if self.state == DONE:
            return
        self._fail_started(exc, reason)

    def _too_large_midway(self) -> None:
        decision = self.decision
        assert decision is not None
        dep = decision.deployment
        self._fail_started(errors.request_too_large(dep.name, self.limit, decision.needs_body), "body_too_large")

    def _fail_started(self, exc: errors.ProxyError, reason: str) -> None:
        decision = self.decision
        assert decision is not None
        dep = decision.deployment
        self._finish_turn(TurnOutcome.UPSTREAM_FAILED)
        if self.resp_started:
            self._abort_client()
        else:
            self.respond_error(exc, dep.name, dep.mode_name, reason, close=True)

    def _upstream_error(self, kind: str, exc: errors.ProxyError) -> None:
        decision = self.decision
        assert decision is not None
        dep = decision.deployment
        client = self.client
        client.engine.metrics.upstream_error(dep.name, kind).inc()
        client.shared.router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
        self.respond_error(exc, dep.name, dep.mode_name, None)

    def _release_upstream(self) -> None:
        conn = self.conn
        if conn is not None:
            self.conn = None
            conn.abort()  # it carries an incomplete request or response: never reuse it

    def _abort_client(self) -> None:
        self._release_upstream()
        self.state = DONE
        client = self.client
        if client.queue and client.queue[0] is self:
            client.queue.popleft()
        client.shared.request_done()
        client.abort()

    def client_gone(self) -> None:
        """The client connection closed: abandon the upstream side (an abandoned stream must not keep a GPU busy)."""
        if not self.started or self.state == DONE:
            return
        self.state = DONE
        self._release_upstream()
        if self.decision is not None:
            self._finish_turn(TurnOutcome.CLIENT_ABORTED)
        self.client.shared.request_done()
