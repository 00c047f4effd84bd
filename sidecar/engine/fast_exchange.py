"""One request/response exchange of the fast engine: routed, forwarded, relayed, ended once.

The client connection (:mod:`sidecar.engine.fast_connection`) makes an :class:`Exchange` per
request head, queues it, and calls :meth:`Exchange.start` when it reaches the head of the queue
(pipelined requests are answered in order), :meth:`Exchange.pump` whenever more of its body was
parsed, :meth:`Exchange.timed_out` from its watchdog, :meth:`Exchange.client_gone` when the
client left. The exchange then:

1. asks the router for its :class:`~sidecar.router.Admission` and does what it needs, in one
   loop (:meth:`Exchange._next`, entered again when a store load or body work it waited for
   is done, :meth:`Exchange._waited`): the body read first when the mode needs it;
2. builds the upstream request head (``_forward``): the client's header lines copied as received
   minus hop-by-hop / ``Connection``-named / ``decision.drop`` / Host / Expect / framing ones,
   then Host, X-Forwarded-For, X-Forwarded-Proto, ``decision.add`` and the framing the parser
   found (Content-Length or chunked): no header filter can remove or change a message's framing;
3. sends it with the body parsed so far on a pooled connection (:mod:`sidecar.engine.fast_upstream`)
   and streams the rest of the body as it is parsed;
4. gets the response head from the connection (:meth:`Exchange.response_head`): the status line
   rebuilt for the client's HTTP version, the upstream's header lines copied minus hop-by-hop and
   ``Connection``-named ones (:mod:`sidecar.engine.head`), and a
   :class:`~sidecar.engine.relay.BodyRelay` that takes the body to the client, bytes unchanged
   (re-framed only when the upstream sent no length, or the client speaks HTTP/1.0);
5. retires exactly once, through :meth:`Exchange._retire`, one of three ways: completed
   (:meth:`Exchange.response_complete`: the last response byte went to the client), answered
   here with a JSON error (:meth:`Exchange.respond_error`), or cut off (``_retire(ABORT)``: the
   upstream failed mid-response, the client left). ``_retire`` releases the upstream connection
   and hands the exchange back to its client connection (:meth:`ClientBase.retired`), which
   serves the next request or closes. The router hears the end of the request once, in
   :meth:`Exchange._finish_admission`.

Every call into the router goes through the admission: ``start`` (admit), ``_next`` and
``_waited`` (what it needs), ``head_sent`` (on_response), ``connect_failed``
(upstream_unreachable) and ``_finish_admission`` (finish, after the last byte went to the client).

Per request there is no task, no future and no timer: everything runs from protocol callbacks,
and the client connection's one watchdog timer enforces the timeouts (:meth:`Exchange.deadline`).
The request path runs tens of thousands of times a second on one core, so its steps are
flattened into few methods; rare paths (errors, unusual framing headers, timeouts) stay in their
own small methods.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from time import perf_counter
from typing import Any

from sidecar import errors
from sidecar.context import TurnOutcome
from sidecar.deployments import Deployment
from sidecar.engine.fast_upstream import FIRST_CHUNKED, FIRST_RAW, UpstreamConnection, UpstreamPool, UpstreamRequest
from sidecar.engine.flow import PEER_FULL, WAITING
from sidecar.engine.head import (
    HAS_CONTENT_LENGTH,
    HAS_TRANSFER_ENCODING,
    NAMES_HEADERS,
    copy_block,
    cut,
    decimal,
    first_value,
    has_header,
    header_map,
    header_values,
    name_table,
    reason_phrase,
    relay_block,
    token_set,
)
from sidecar.engine.idle_poll import IdlePoller
from sidecar.engine.parse_errors import UNSUPPORTED_CODING, ParseError
from sidecar.engine.phases import (
    ABORT,
    BUFFERING,
    CLOSE,
    CONNECTING,
    DONE,
    KEEP,
    LOADING,
    QUEUED,
    SENDING,
    SENT,
    TRANSFORMING,
)
from sidecar.engine.relay import CHUNKED, DECHUNK, EOF_CHUNKED, EOF_RAW, LENGTH, BodyRelay
from sidecar.engine.request_rules import check, lone_chunked
from sidecar.engine.wire import (
    CHUNKED_LINE,
    CL_LINE,
    CL_ZERO,
    CLOSE_LINE,
    CONNECTION_B,
    CONTINUE,
    EXPECT_B,
    HTTP10,
    HTTP11,
    KEEPALIVE_LINE,
    LAST_CHUNK,
    METHODS,
    NO_EMPTY_LENGTH,
    REQUEST_DROP,
    STATUS_CODE,
    TRANSFER_ENCODING_B,
    UPGRADE_B,
    XFF,
    XFF_B,
    XFF_LINE,
    XFP,
    XFP_B,
    XFP_LINE,
    error_response,
)
from sidecar.router import BODY, LOAD, READY, REFUSED, WORK, Admission, Decision, RequestHead, Router
from sidecar.usage import UsageReader

log = logging.getLogger("sidecar.engine")

# Request body bytes held while no upstream connection is attached yet before reading pauses.
WAIT_BUFFER = 64 * 1024
# A buffered body larger than this goes to the transport in a write of its own.
_SEPARATE_WRITE = 256 * 1024
_FRAMING = HAS_CONTENT_LENGTH | HAS_TRANSFER_ENCODING
# While a response streams, the watchdog looks for reads this often (a share of the idle
# timeout) instead of each read taking the time: a silence is noticed within 1.25x the timeout.
_IDLE_CHECKS = 4

_INF = float("inf")

# Mode header name -> (lower-case key, b"Name: ", lower-case bytes); names come from the modes: a handful.
_ADD_NAMES: dict[str, tuple[str, bytes, bytes]] = {}
# The outcomes of every response, as module constants: an Enum member read from its class goes
# through EnumType.__getattr__ (hundreds of instructions per read).
_COMPLETED = TurnOutcome.COMPLETED
_UPSTREAM_FAILED = TurnOutcome.UPSTREAM_FAILED
_CLIENT_ABORTED = TurnOutcome.CLIENT_ABORTED


def _add_name(name: str) -> tuple[str, bytes, bytes]:
    entry = (name.lower(), name.encode("latin-1") + b": ", name.lower().encode("latin-1"))
    if len(_ADD_NAMES) < 256:
        _ADD_NAMES[name] = entry
    return entry


class EngineState:
    """What every connection of one engine reads or updates per request, in one typed object
    (compiled, a struct: the engine itself is a Python class, whose attributes cost a lookup each)."""

    __slots__ = (
        "engine",
        "router",
        "upstreams",
        "drops",
        "gauge",
        "health",
        "in_flight",
        "draining",
        "drained",
        "poller",
    )

    def __init__(self, engine: Any, router: Router, gauge: Any, health: Any) -> None:
        self.engine = engine  # the FastEngine: metrics, failure log, loop, body pool (rare paths)
        self.router = router
        # Upstream.pool_key -> (pool, b" " + base path, b" HTTP/1.1\r\nHost: ...\r\n")
        self.upstreams: dict[str, tuple[UpstreamPool, bytes, bytes]] = {}
        self.drops: dict[frozenset[str], frozenset[str]] = {}
        self.gauge = gauge  # the in-flight gauge's child, set from ``in_flight`` (no call per request)
        self.health = health
        self.in_flight = 0
        self.draining = False
        self.drained: asyncio.Future[None] | None = None  # set while a drain waits for in_flight == 0
        self.poller: IdlePoller = None  # type: ignore[assignment]  # set when the engine starts, before any read

    def request_started(self) -> None:
        self.in_flight += 1
        self.gauge.value = self.in_flight

    def request_done(self) -> None:
        """A request left the engine (answered, refused or abandoned)."""
        self.in_flight -= 1
        self.gauge.value = self.in_flight
        drained = self.drained
        if drained is not None and self.in_flight == 0 and not drained.done():
            drained.set_result(None)

    def drop_for(self, drop: frozenset[str]) -> frozenset[str]:
        """Request headers never forwarded for a decision's ``drop`` (cached: one per deployment)."""
        drops = self.drops
        if drop in drops:
            return drops[drop]
        never = REQUEST_DROP | {name.lower() for name in drop}
        if len(drops) < 64:
            drops[drop] = never
        return never


class ClientBase:
    """What an exchange may use of the client connection it belongs to
    (:class:`~sidecar.engine.fast_connection.ClientConnection` implements the methods).

    ``output`` gathers the bytes for the client (written once per event); ``flow`` pauses the
    client's reading; ``write_paused`` says its write buffer is full; ``timer_due`` is when its
    watchdog fires next."""

    __slots__ = ("shared", "loop", "output", "flow", "peer", "xff_xfp", "write_paused", "timer_due")

    def __init__(self, shared: EngineState, loop: asyncio.AbstractEventLoop) -> None:
        self.shared = shared
        self.loop = loop
        self.peer = b""
        self.xff_xfp = b""
        self.write_paused = False
        self.timer_due = _INF

    def retired(self, ex: Exchange, close: int) -> None:
        """``ex`` retired (called once per started exchange, by ``Exchange._retire``): count it out,
        then serve the next request (``KEEP``), close after what was written (``CLOSE``), or drop
        the connection now (``ABORT``: an incomplete response must stay incomplete)."""
        raise NotImplementedError

    def arm_watchdog(self, due: float, now: float) -> None:
        """Fire the watchdog at ``due`` (perf_counter time) at the latest."""
        raise NotImplementedError

    def flush(self) -> None:
        """Write what ``output`` gathered."""
        raise NotImplementedError

    def pause(self, reason: int) -> None:
        """Stop reading the client for ``reason`` (a :mod:`~sidecar.engine.flow` bit); the
        watchdog then looks for the client's close, which a paused transport does not report."""
        raise NotImplementedError


class Exchange(UpstreamRequest):
    """One request/response: routed, forwarded, relayed, ended exactly once (module docstring).
    Made by :func:`new_exchange`."""

    __slots__ = (
        # connection
        "client",
        "shared",
        "phase",
        # request head
        "method",
        "target",
        "raw",
        "block_start",
        "block_end",
        "slow_headers",
        "http10",
        "keep_alive",
        "expect",
        "conn_tokens",
        "error",
        # request body
        "length",
        "chunked",
        "body",
        "body_size",
        "complete",
        "limit",
        # routing
        "admission",
        "decision",
        # upstream
        "conn",
        "waiting_pool",
        "upstream_head",
        "frame_chunked",
        # timing
        "t0",
        "connect_timeout",
        "first_byte_timeout",
        "idle_timeout",
        "last_io",
        "seen_reads",
        # response
        "resp_status",
        "resp_head",
        "head_at",
        "close_after",
        "reads_id",
        "usage",
    )

    def setup(
        self,
        client: ClientBase,
        raw: bytes,
        block_start: int,
        block_end: int,
        method: bytes,
        target: bytes,
        keep_alive: bool,
        length: int,
    ) -> None:
        """Its fields, for the request whose header block is ``raw[block_start:block_end]``
        (``client``'s; called once, by :func:`new_exchange`, which makes every exchange)."""
        # -- connection: whose it is, and where it is (sidecar.engine.phases; DONE: retired)
        self.client = client
        self.shared = client.shared
        self.phase = QUEUED
        # -- request head: the header block (sidecar.engine.head) is read by the router through a
        # HeaderBlock view and forwarded as slices of the lines it keeps
        self.method = method
        self.target = target
        self.raw = raw
        self.block_start = block_start
        self.block_end = block_end
        self.slow_headers = False  # a header the fast path does not handle (see check_head, _forward)
        self.http10 = False
        self.keep_alive = keep_alive
        self.expect = False  # Expect: 100-continue
        self.conn_tokens: set[str] | frozenset[str] = frozenset()
        self.error: tuple[errors.ProxyError, str] | None = None  # refused: answered here instead
        # -- request body
        self.length = length  # declared Content-Length, -1 without
        self.chunked = False
        self.body: list[bytes] = []  # parsed body bytes not yet forwarded
        self.body_size = 0
        self.complete = False  # the whole request was parsed
        self.limit = 0  # the body bytes allowed (413 above)
        # -- routing
        self.admission: Admission | None = None
        self.decision: Decision | None = None  # the admission's, once forwarded
        # -- upstream
        self.conn: UpstreamConnection | None = None
        self.waiting_pool: UpstreamPool | None = None  # the pool it asked for a connection, until it got one
        self.upstream_head: list[bytes] = []  # the upstream request's pieces while no connection is attached
        self.frame_chunked = False  # the body goes upstream chunked
        # -- timing (perf_counter times; the watchdog reads them through deadline)
        self.t0 = 0.0  # started
        self.connect_timeout = 0.0
        self.first_byte_timeout = 0.0
        self.idle_timeout = 0.0
        self.last_io = 0.0  # when the body a mode reads, or the response, last moved
        self.seen_reads = 0  # the response relay's read count when the watchdog last looked
        # -- response: it has begun once resp_status is set
        self.resp_status = 0
        self.resp_head: Mapping[str, str] | None = None  # parsed, until the router heard of it (head_sent)
        self.head_at = 0.0
        self.close_after = False  # the response closes the connection after it
        self.reads_id = False  # the router reads the body's first bytes for the response's id
        self.usage: UsageReader | None = None  # the reader of its prompt-cache usage, if accounted

    # -- request head -------------------------------------------------------------------------

    def check_head(self, version: int, head_bits: int) -> None:
        """The request-head rules (:mod:`sidecar.engine.request_rules`) for a head off the fast
        path, and what forwarding it needs to know of it (HTTP/1.0, Connection tokens, chunked,
        Expect). ``version`` is ``10 * major + minor``; ``head_bits`` are the head's
        :func:`~sidecar.engine.head.scan_request` bits."""
        raw, first, end = self.raw, self.block_start, self.block_end
        self.http10 = version == 10
        connection = header_values(raw, first, end, CONNECTION_B, False)
        if connection:
            self.conn_tokens = token_set(connection)
        codings = header_values(raw, first, end, TRANSFER_ENCODING_B, False)
        self.chunked = len(codings) > 0
        upgrade = "upgrade" in self.conn_tokens and has_header(raw, first, end, UPGRADE_B)
        self.target, self.error = check(version, head_bits, codings, upgrade, self.method, self.target)
        expect = first_value(raw, first, end, EXPECT_B)
        self.expect = expect is not None and expect.lower() == b"100-continue"

    # -- request path -------------------------------------------------------------------------

    def start(self) -> None:
        """Admit the request at the head of the queue; forward it unless answered here."""
        shared = self.shared
        self.phase = BUFFERING
        shared.request_started()
        if self.error is not None:
            exc, reason = self.error
            d = shared.router.default
            self.respond_error(exc, d.name, d.mode_name, reason, close=True)
            return
        self.t0 = perf_counter()
        method = self.method
        self.admission = shared.router.admit(
            RequestHead(
                METHODS[method] if method in METHODS else method.decode("latin-1"),
                header_map(self.raw, self.block_start, self.block_end),
                self.target,
            )
        )
        self._next()

    def _next(self) -> None:
        """Do what the admission needs next: the one routing loop of this engine, entered again
        when a load or body work it waited for is done."""
        adm = self.admission
        assert adm is not None
        need = adm.need
        decision = adm.decision
        if need == READY and decision is not None and decision.body is not None:  # the body was read
            body = decision.body
            if body:
                self.body.append(body)
            self._forward(decision, len(body))
            return
        if need == LOAD or need == WORK:
            self._wait(need)
            return
        dep = adm.deployment
        if need == REFUSED:
            assert adm.error is not None
            self.respond_error(adm.error, dep.name, dep.mode_name, adm.reason, close=adm.reason is None)
            return
        self.limit = limit = adm.limit
        if self.length > limit or self.body_size > limit:
            adm.finish(_UPSTREAM_FAILED)
            # A declared length whose body is already parsed leaves nothing to skip: keep the
            # connection. A chunked body over the limit, or one still arriving, ends it.
            err = adm.too_large()
            self.respond_error(err, dep.name, dep.mode_name, "body_too_large", close=self.chunked or not self.complete)
            return
        if self.expect and not self.complete and not self.http10:
            self.client.output.parts.append(CONTINUE)
        if need == BODY:
            if self.complete:
                self._whole_body()
            else:
                self._await_body(dep)
            return
        assert decision is not None
        self._forward(decision, -1)

    def _wait(self, need: int) -> None:
        """Load the request's session from the shared store (LOAD: a rare path, the first request
        of a session this replica does not hold), or run body work on a worker thread (WORK: a
        large body); the admission goes on in :meth:`_waited`. Body bytes keep arriving meanwhile
        (buffered as while connecting)."""
        adm = self.admission
        assert adm is not None
        if need == LOAD:
            self.phase = LOADING
            assert adm.identity is not None
            task = self.client.loop.create_task(self.shared.router.state.load(adm.identity))
            task.add_done_callback(self._waited)
        else:
            self.phase = TRANSFORMING
            engine = self.shared.engine
            future = engine.loop.run_in_executor(engine.body_pool, adm.work)
            future.add_done_callback(self._waited)

    def _waited(self, future: asyncio.Future[Any]) -> None:
        phase = self.phase
        if phase != LOADING and phase != TRANSFORMING:  # the client left meanwhile (its admission finished)
            if not future.cancelled():
                future.exception()  # retrieved: nothing left to report
            return
        self.phase = BUFFERING
        client = self.client
        adm = self.admission
        assert adm is not None
        if phase == LOADING:
            client.flow.resume(WAITING)  # routed now: reading goes on as the decision says
            adm.loaded()
        else:
            adm.worked(None if future.cancelled() else future.result())
        try:
            self._next()
        except Exception as exc:  # a bug must cost one request, not the connection
            log.error("request failed in the engine: %r", exc, exc_info=exc)
            self.internal_error()
        client.flush()

    def _await_body(self, dep: Deployment) -> None:
        """The body a mode reads is still arriving: bound its arrival like a response's (the
        deployment's first-byte timeout for all of it, its idle timeout between reads)."""
        self.first_byte_timeout = dep.first_byte_timeout
        self.idle_timeout = dep.idle_timeout
        self.last_io = now = self.t0
        due = self.deadline(now)
        client = self.client
        if due < client.timer_due:
            client.arm_watchdog(due, now)

    def _forward(self, decision: Decision, length: int) -> None:
        """Build the upstream request head and send it with the body parsed so far on a pooled
        connection (or wait for one). ``length >= 0`` replaces the body framing (transformed body).

        Flattened (head building, metrics, connection pick and attach in one method): it runs
        once per forwarded request."""
        self.decision = decision
        client = self.client
        shared = self.shared
        pool, base, version_host = shared.upstreams[decision.upstream.pool_key]
        raw = self.raw
        dropped = decision.drop
        drops = shared.drops
        drop = drops.get(dropped)
        if drop is None:
            drop = shared.drop_for(dropped)
        if self.conn_tokens:
            drop = drop | self.conn_tokens
        add = decision.add
        lines: list[bytes] = []  # the mode's header lines
        for name, value in add:
            entry = _ADD_NAMES.get(name)
            if entry is None:
                entry = _add_name(name)
            key = entry[0]
            if key not in drop and has_header(raw, self.block_start, self.block_end, entry[2]):
                drop = drop | {key}  # the mode's value replaces a client header of the same name
            lines.append(entry[1])
            lines.append(value.encode("utf-8", "surrogateescape"))
            lines.append(b"\r\n")
        parts = [self.method, base, self.target, version_host]
        copy_block(raw, self.block_start, self.block_end, parts, name_table(drop))
        if self.slow_headers:
            self._forwarded_for(parts, drop, dropped)
        else:
            parts.append(client.xff_xfp)
        parts.extend(lines)
        # The framing, from what the parser found (never from the client's header lines).
        if length >= 0:
            parts.append(CL_LINE)
            parts.append(decimal(length))
            parts.append(b"\r\n\r\n")
        elif self.chunked:
            parts.append(CHUNKED_LINE)
            parts.append(b"\r\n")
            self.frame_chunked = True
        elif self.length >= 0:
            parts.append(CL_LINE)
            parts.append(decimal(self.length))
            parts.append(b"\r\n\r\n")
        elif self.method not in NO_EMPTY_LENGTH:
            parts.append(CL_ZERO)
            parts.append(b"\r\n")
        else:
            parts.append(b"\r\n")

        dep = decision.deployment
        now = perf_counter()
        self.phase = CONNECTING
        self.connect_timeout = dep.connect_timeout
        self.idle_timeout = idle = dep.idle_timeout
        # Like the aiohttp client's sock_read, silence before the head is bounded by `idle` too.
        first_byte = dep.first_byte_timeout
        self.first_byte_timeout = first_byte = idle if idle < first_byte else first_byte
        due = self.t0 + first_byte
        if due < client.timer_due:
            client.arm_watchdog(due, now)

        conn = pool.take(now)
        if conn is None:
            self.upstream_head = parts
            self.waiting_pool = pool
            pool.acquire(self)
            if self.phase == CONNECTING and self.body_size > WAIT_BUFFER and not self.complete:
                client.pause(WAITING)
        else:
            self.conn = conn
            conn.bind(self, client.write_paused)
            self._send(conn, parts)
        stats = dep.stats  # (the request left first: the metric is off its latency path)
        stats.added.observe(now - self.t0)

    def _forwarded_for(self, parts: list[bytes], drop: frozenset[str] | set[str], dropped: frozenset[str]) -> None:
        """X-Forwarded-For / -Proto when the client sent forwarding headers of its own."""
        client = self.client
        raw, first, end = self.raw, self.block_start, self.block_end
        xff = b""
        if XFF not in self.conn_tokens and XFF not in dropped:
            xff = b", ".join(header_values(raw, first, end, XFF_B, False))
        parts += (XFF_LINE, xff + b", " + client.peer if xff else client.peer, b"\r\n")
        if XFP in drop or not has_header(raw, first, end, XFP_B):
            parts.append(XFP_LINE)

    def pump(self) -> None:
        """Client bytes were parsed: forward, buffer or refuse them according to the phase."""
        phase = self.phase
        if phase >= SENT:
            return
        if phase == LOADING:  # not routed yet: buffer, as while waiting for a connection
            if self.body_size > WAIT_BUFFER and not self.complete:
                self.client.pause(WAITING)
            return
        if self.body_size > self.limit:
            self._too_large_midway()
        elif phase == SENDING:
            out: list[bytes] = []
            if self.body:
                self._frame_body(out)
            complete = self.complete
            if complete:
                if self.frame_chunked:
                    out.append(LAST_CHUNK)
                self.phase = SENT
            if out:
                conn = self.conn
                assert conn is not None
                conn.send(out, complete)
        elif phase == BUFFERING:
            if self.complete:
                self._whole_body()
            else:
                self.last_io = perf_counter()  # body bytes arrived (see deadline)
        elif phase == CONNECTING and self.body_size > WAIT_BUFFER and not self.complete:
            self.client.pause(WAITING)

    def _whole_body(self) -> None:
        """The whole body the admission needs is here: the router reads (or rewrites) it."""
        body = self.body
        raw = body[0] if len(body) == 1 else list(body)  # a large body is joined off the loop
        body.clear()
        adm = self.admission
        assert adm is not None
        adm.body(raw, self.body_size)
        self._next()

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
        return self.phase == CONNECTING

    def attach(self, conn: UpstreamConnection) -> None:
        """A connection for a request that waited for one (opened, or freed by another)."""
        self.waiting_pool = None
        self.conn = conn
        client = self.client
        conn.bind(self, client.write_paused)
        client.flow.resume(WAITING)
        parts = self.upstream_head
        self.upstream_head = []
        self._send(conn, parts)

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
        complete = self.complete
        if complete:
            if self.frame_chunked:
                parts.append(LAST_CHUNK)
            self.phase = SENT
        else:
            self.phase = SENDING
        if large is None:
            conn.send(parts, complete)
        else:
            conn.send(parts, False)
            conn.send([large], complete)

    def connect_failed(self, kind: str, exc: BaseException) -> None:
        if self.phase != CONNECTING:
            # ``tls``: the upstream refused the TLS session after the request was written to it
            # (it never reached the application); nothing to do once a response began.
            if kind != "tls" or self.phase == DONE or self.resp_status:
                return
            self.conn = None
        if kind == "timeout":
            self._upstream_failed("timeout", "connect timed out", True)
        else:
            self._upstream_failed("connect", errors.failure_reason(exc), True)

    def peer_full(self, full: bool) -> None:
        if full:
            self.client.pause(PEER_FULL)
        else:
            self.client.flow.resume(PEER_FULL)

    def response_head(
        self, status: int, raw: bytes, start: int, first: int, end: int, length: int, now: float
    ) -> BodyRelay | None:
        """The upstream's final response head (status line at ``raw[start:first]``, header block
        ``raw[first:end]``, declared Content-Length ``length``, -1 without one): put the client's
        head in its output and return the relay of the body (None: no body). Flattened: once per
        request; the router hears of the head in :meth:`head_sent`. Raises :class:`ParseError`,
        the client's output as it was, for a body framed by a coding besides chunked."""
        client = self.client
        self.resp_status = status
        self.last_io = now
        self.resp_head = header_map(raw, first, end)
        self.head_at = now
        http10 = self.http10
        output = client.output
        out = output.parts
        base = len(out)
        if not http10 and raw.startswith(HTTP11, start) and raw[start + 12] == 32:
            # HTTP/1.1 both ways, and the SP before the reason is there (llhttp checked the
            # rest of the line): the status line goes as it came, in one piece.
            out.append(cut(raw, start, first))
        else:
            out += (
                HTTP10 if http10 else HTTP11,
                STATUS_CODE[status] if status in STATUS_CODE else b"%d" % status,
                b" ",
                reason_phrase(raw, start, first),
                b"\r\n",
            )
        mark = len(out)
        framing = relay_block(raw, first, end, out, None)  # the header lines minus hop-by-hop ones
        if framing & NAMES_HEADERS:  # not the usual single "keep-alive" or "close"
            del out[mark:]
            relay_block(raw, first, end, out, token_set(header_values(raw, first, end, CONNECTION_B, False)))
        if self.method == b"HEAD" or status == 204 or status == 304:
            mode = -1  # no body
        elif framing & _FRAMING == HAS_CONTENT_LENGTH:
            mode = LENGTH
        elif framing & HAS_TRANSFER_ENCODING:
            if not lone_chunked(header_values(raw, first, end, TRANSFER_ENCODING_B, False)):
                # Re-framed as chunked, another coding's bytes would reach the client unlabelled.
                del out[base:]
                self.resp_status = 0
                self.resp_head = None
                raise ParseError(UNSUPPORTED_CODING)
            mode = DECHUNK if http10 else CHUNKED
        else:  # delimited by the upstream's close
            mode = EOF_RAW if http10 else EOF_CHUNKED
        if mode == CHUNKED or mode == EOF_CHUNKED:
            out.append(CHUNKED_LINE)
        if not (self.keep_alive and self.complete and mode != DECHUNK and mode != EOF_RAW and not self.shared.draining):
            if not http10:  # closing is HTTP/1.0's default
                out.append(CLOSE_LINE)
            self.close_after = True
        elif http10:
            out.append(KEEPALIVE_LINE)
        out.append(b"\r\n")
        if mode < 0:
            return None
        conn = self.conn
        adm = self.admission
        assert conn is not None and adm is not None
        framed = mode == CHUNKED or mode == DECHUNK  # the upstream's bytes carry chunked framing
        if adm.reads_response_id and adm.reads_response(status, self.resp_head):
            # (a request chained by previous_response_id: the router reads the body's first bytes)
            self.reads_id = True
            conn.first_bytes = FIRST_CHUNKED if framed else FIRST_RAW
        if adm.turn is not None:  # a session's: its prompt-cache usage is read from the body's ends
            usage = adm.usage_reader(status, self.resp_head, framed)
            if usage is not None:
                self.usage = usage
                conn.read_usage(usage)
                conn.first_bytes = FIRST_CHUNKED if framed else FIRST_RAW
        return BodyRelay(output, mode, length if mode == LENGTH else 0, conn.pool.max_head)

    def head_sent(self) -> None:
        """The response head went to the client: tell the router and the metrics now (off the
        latency path; in any case before the turn finishes, see _finish_admission)."""
        headers = self.resp_head
        if headers is None:
            return
        self.resp_head = None
        conn = self.conn
        if conn is not None and conn.relay is not None and self.idle_timeout:
            # the body streams on: the watchdog looks for its reads from the head on (armed for
            # the first byte, its first look could come a whole idle timeout late, and a silence
            # be noticed only after twice the timeout)
            due = self.head_at + self.idle_timeout / _IDLE_CHECKS
            client = self.client
            if due < client.timer_due:
                client.arm_watchdog(due, perf_counter())
        shared = self.shared
        decision = self.decision
        assert decision is not None
        health = shared.health
        if not health.settled:
            health.answered(decision.deployment, decision.upstream)
        stats = decision.deployment.stats
        stats.ttfb.observe(self.head_at - self.t0)
        adm = self.admission
        assert adm is not None
        adm.on_response(self.resp_status, headers)

    def response_start(self, data: bytes, chunked: bool) -> bool:
        """A read of the beginning of the response body (see response_head): to the router,
        for the response's id, and to the usage reader, until neither wants more."""
        done = True
        if self.reads_id:
            adm = self.admission
            assert adm is not None
            if adm.response_start(data, chunked):
                self.reads_id = False
            else:
                done = False
        usage = self.usage
        if usage is not None and not usage.first(data):
            done = False
        return done

    def response_complete(self, now: float) -> None:
        """The last response byte went to the client (the connection has unbound itself): count,
        finish the turn, end (flattened: once per request)."""
        self.conn = None
        self.client.flush()  # a response without a body: its head is still in the output
        decision = self.decision
        assert decision is not None
        stats = decision.deployment.stats
        assert stats is not None
        status = self.resp_status
        stats.request(status).inc()
        stats.duration.observe(now - self.t0)
        usage = self.usage
        if usage is not None:  # the body went whole: what it said of its usage, before the turn ends
            self.usage = None
            if self.resp_head is not None:
                self.head_sent()
            adm = self.admission
            assert adm is not None
            adm.on_usage(usage.result())
        self._finish_admission(_COMPLETED if status < 500 else _UPSTREAM_FAILED)
        # An unread rest of the request body is never read: the connection closes.
        self._retire(CLOSE if self.close_after or not self.complete else KEEP)

    def upstream_failed(self, message: str) -> None:
        """The upstream connection failed (it has detached itself)."""
        self.conn = None
        if self.phase != DONE:
            self._upstream_failed("reset" if self.resp_status else "protocol", message, False)

    # -- timeouts (see fast_connection.ClientConnection._watchdog) --------------------------------

    def deadline(self, now: float) -> float:
        """When the watchdog must look at this request next (perf_counter time; inf: never):
        when it times out as things stand, or, while its response streams, when to look for
        reads since the last look."""
        phase = self.phase
        if phase == BUFFERING and self.admission is not None and self.idle_timeout:
            body_due = self.last_io + self.idle_timeout
            whole = self.t0 + self.first_byte_timeout
            return body_due if body_due < whole else whole
        if phase < CONNECTING or phase == DONE:
            return _INF
        if not self.resp_status:
            return self.t0 + self.first_byte_timeout
        conn = self.conn
        if conn is not None and conn.relay is not None:
            reads = conn.relay.reads
            if reads != self.seen_reads:  # it moved since the last look
                self.seen_reads = reads
                self.last_io = now
            check = now + self.idle_timeout / _IDLE_CHECKS
            due = self.last_io + self.idle_timeout
            return due if due < check else check
        return self.last_io + self.idle_timeout

    def timed_out(self, now: float) -> None:
        adm = self.admission
        assert adm is not None
        dep = adm.deployment
        if self.phase == BUFFERING:  # the client stopped sending the body a mode reads
            self._finish_admission(_CLIENT_ABORTED)
            self.respond_error(
                errors.request_timeout(f"the request body stalled (deployment {dep.name!r})"),
                dep.name,
                dep.mode_name,
                errors.REQUEST_TIMEOUT,
                close=True,
            )
            return
        if self.resp_status:
            self._upstream_failed("timeout", f"idle for {self.idle_timeout:g} s", False)
        else:
            self._upstream_failed("timeout", f"no response within {self.first_byte_timeout:g} s", False)

    # -- failures and local answers ---------------------------------------------------------

    def _upstream_failed(self, kind: str, reason: str, connecting: bool) -> None:
        """The upstream failed (``kind``: timeout, connect, protocol, reset; ``reason``: client
        safe, see :meth:`Engine.upstream_failure`): answered 502/504 before the response began;
        after it the status line is gone, so the only honest signal left is an incomplete
        response (an aborted connection), not a clean end."""
        decision = self.decision
        assert decision is not None
        dep, up = decision.deployment, decision.upstream
        engine = self.shared.engine
        if self.resp_status:
            reason = f"mid-response: {reason}"
        engine.upstream_failure(dep, up, kind, reason, connecting=connecting)
        if kind == "connect":
            assert self.admission is not None
            self.admission.upstream_unreachable()  # nothing was sent: fail the tree over
        engine.metrics.upstream_error(dep.name, kind).inc()
        self._finish_admission(_UPSTREAM_FAILED)
        if self.resp_status:
            self._retire(ABORT)
        else:
            self.respond_error(errors.upstream_failed(kind, dep.name, up.index, reason), dep.name, dep.mode_name, None)

    def respond_error(
        self, exc: errors.ProxyError, dep_name: str, mode_name: str, reason: str | None, close: bool = False
    ) -> None:
        """Answer with the JSON error and end (the router's turn, if any, is already finished)."""
        metrics = self.shared.engine.metrics
        metrics.request_counter(dep_name, mode_name, f"{exc.status // 100}xx").inc()
        if reason:
            metrics.rejected.labels(reason).inc()
        keep = not close and self.keep_alive and self.complete and not self.shared.draining
        self.client.output.parts.append(error_response(exc, self.http10, keep, self.method == b"HEAD"))
        self._retire(KEEP if keep else CLOSE)

    def internal_error(self) -> None:
        if self.phase == DONE:
            return
        if self.admission is not None:
            self._finish_admission(_UPSTREAM_FAILED)
        d = self.shared.router.default
        self.respond_error(errors.internal_error(), d.name, d.mode_name, None, close=True)

    def refused(self, exc: errors.ProxyError, reason: str) -> None:
        """The body of this started request turned out malformed or too large: never complete it
        upstream (answered ``exc`` while no response began, else cut off)."""
        adm = self.admission
        if self.phase == DONE or adm is None:
            return
        dep = adm.deployment
        self._finish_admission(_UPSTREAM_FAILED)
        if self.resp_status:
            self._retire(ABORT)
        else:
            self.respond_error(exc, dep.name, dep.mode_name, reason, close=True)

    def _too_large_midway(self) -> None:
        adm = self.admission
        assert adm is not None
        self.refused(adm.too_large(), "body_too_large")

    def client_gone(self) -> None:
        """The client connection closed: abandon the upstream side (an abandoned stream must not keep a GPU busy)."""
        if self.phase == QUEUED or self.phase == DONE:
            return
        conn = self.conn
        if conn is not None:
            conn.client_gone()  # the body's end may have gone out already: then the response ended
            if self.phase == DONE:
                return
        if self.admission is not None:
            self._finish_admission(_CLIENT_ABORTED)
        self._retire(ABORT)

    # -- the end: the router's (finish), the exchange's (retire) ---------------------------------

    def _finish_admission(self, outcome: TurnOutcome) -> None:
        """Finish the request's admission (only its first finish counts): after the response
        head the router has not heard of yet, if any, and the usage of a response whose body did
        not end (its client left, its upstream failed mid-body), if what was read of it
        reported counts (the client that closes once it read ``[DONE]``, before the body's last
        chunk, had them); else that response is not counted: its usage may have been coming."""
        if self.resp_head is not None:
            self.head_sent()
        adm = self.admission
        assert adm is not None  # every exchange that ends a turn was admitted
        usage = self.usage
        if usage is not None:
            self.usage = None
            conn = self.conn
            if conn is not None:  # (else it unbound itself, handing the reader its last reads)
                conn.end_usage()
            found = usage.result()
            if found.reported:
                adm.on_usage(found)
        adm.finish(outcome)

    def _retire(self, close: int) -> None:
        """The exchange is over and leaves its connection's queue: every way it ends goes through
        here, exactly once. An upstream connection still attached carries an incomplete request
        or response: never reused."""
        self.phase = DONE
        conn = self.conn
        if conn is not None:
            self.conn = None
            conn.abort()
        pool = self.waiting_pool
        if pool is not None:  # it ended waiting (client gone, timeout): its head and body go now,
            self.waiting_pool = None  # not when a connection frees up
            pool.forget(self)
        self.client.retired(self, close)


def new_exchange(
    client: ClientBase,
    raw: bytes,
    first: int,
    end: int,
    method: bytes,
    target: bytes,
    keep_alive: bool,
    length: int,
) -> Exchange:
    """``Exchange(...)`` as the engine makes one per request: compiled, an allocation and a C call
    (calling the class packs the arguments into a tuple and parses them: an extension type that
    derives from another is constructed without vectorcall)."""
    ex = Exchange.__new__(Exchange)
    ex.setup(client, raw, first, end, method, target, keep_alive, length)
    return ex
