"""The protocol-level engine: asyncio Protocols, llhttp parsing, raw byte forwarding.

One :class:`_ClientConnection` per client connection feeds its bytes to
``httptools.HttpRequestParser`` (llhttp, strict: no lenient flags). Each parsed request head
becomes an :class:`_Exchange`, queued in arrival order; only the head of the queue is routed and
forwarded, so pipelined requests are answered in order (reading pauses while a later request
waits). The exchange rebuilds only the request head (request line, the client's headers minus
hop-by-hop / ``Connection``-named / ``decision.strip`` / Host / Expect, then Host,
X-Forwarded-For, X-Forwarded-Proto and ``decision.add``), streams the body as it is parsed to a
pooled upstream connection (:mod:`sidecar.engine.fast_client`), and relays the response as it
arrives: upstream body bytes are written unchanged, re-framed as chunked when the upstream did
not send a length (close-delimited for HTTP/1.0 clients). Per request there is no task and no
future: everything runs from protocol callbacks and two timer handles at most.

Backpressure (:mod:`sidecar.engine.flow`): a write buffer above its high-water mark on one side
pauses reading on the other until it drains.

Framing the engine refuses with ``400 bad_request`` and a close (never forwarded): anything
llhttp rejects (Content-Length with Transfer-Encoding, duplicate Content-Length, bad chunk
sizes, bare LF, whitespace before colons, ...), a Transfer-Encoding other than exactly
``chunked``, Transfer-Encoding on HTTP/1.0, HTTP versions other than 1.0 / 1.1, and request
targets that are not origin-form (``/path``). Upstreams must be plain ``http://``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterator, Mapping
from http import HTTPStatus
from time import perf_counter
from typing import Any, cast

import httptools

from sidecar import errors
from sidecar import headers as h
from sidecar.config import ConfigError
from sidecar.engine.base import Engine
from sidecar.engine.fast_client import BODY_FRAMED, BODY_NONE, BODY_UNTIL_EOF, UpstreamConnection, UpstreamPool
from sidecar.engine.flow import CLIENT_FULL, PEER_FULL, PIPELINED, STOPPED, WAITING, ReadFlow
from sidecar.lineage import TurnOutcome
from sidecar.router import Decision, RequestHead

log = logging.getLogger("sidecar.engine")

# An idle keep-alive client connection is closed after this long (nginx's default).
KEEPALIVE_TIMEOUT = 75.0
# After answering a request whose body was not read, keep reading (and discarding) for this long
# before closing, so the client sees the answer instead of a reset.
LINGER_SECONDS = 2.0
# Request body bytes held while no upstream connection is attached yet before reading pauses.
WAIT_BUFFER = 64 * 1024

_HOP = frozenset(n.encode() for n in h.HOP_BY_HOP)
_REQ_DROP = _HOP | {h.HOST.lower().encode(), h.EXPECT.lower().encode(), h.X_FORWARDED_FOR.lower().encode()}
_CONNECTION = h.CONNECTION.lower().encode()
_CONTENT_LENGTH = h.CONTENT_LENGTH.lower().encode()
_TRANSFER_ENCODING = h.TRANSFER_ENCODING.lower().encode()
_EXPECT = h.EXPECT.lower().encode()
_UPGRADE = h.UPGRADE.lower().encode()
_XFF_STR = h.X_FORWARDED_FOR.lower()
_XFF = _XFF_STR.encode()
_XFP = h.X_FORWARDED_PROTO.lower().encode()
_XFF_LINE = h.X_FORWARDED_FOR.encode() + b": "
_XFP_LINE = h.X_FORWARDED_PROTO.encode() + b": http\r\n"
_CL_LINE = h.CONTENT_LENGTH.encode() + b": "
_CHUNKED_LINE = h.TRANSFER_ENCODING.encode() + b": chunked\r\n"
_CLOSE_LINE = h.CONNECTION.encode() + b": close\r\n"
_KEEPALIVE_LINE = h.CONNECTION.encode() + b": keep-alive\r\n"
_JSON_HEAD = h.CONTENT_TYPE.encode() + b": application/json\r\n" + _CL_LINE
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
# Methods for which the aiohttp client sends no ``Content-Length: 0`` on an empty body (parity).
_NO_EMPTY_LENGTH = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE"})
_STATUS_CODE = {s.value: b"%d" % s.value for s in HTTPStatus}
_STATUS_LINE = {s.value: b"%d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}

# Exchange states.
QUEUED, BUFFERING, CONNECTING, SENDING, SENT, DONE = range(6)
# How the response body is framed towards the client.
R_NONE, R_LENGTH, R_CHUNKED, R_CLOSE = range(4)


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the reason is on the connection."""


def _too_large(dep: str, limit: int) -> errors.ProxyError:
    return errors.ProxyError(errors.REQUEST_TOO_LARGE, f"request body exceeds {limit} bytes (deployment {dep!r})",
                             deployment=dep, limit=limit)


def _bad_request(message: str) -> errors.ProxyError:
    return errors.ProxyError(errors.BAD_REQUEST, message)


def _tokens(values: Iterator[bytes]) -> set[bytes]:
    """Lower-cased comma-separated tokens of header values (``Connection``)."""
    out = set()
    for value in values:
        for token in value.split(b","):
            token = token.strip().lower()
            if token:
                out.add(token)
    return out


_KEYS: dict[str, bytes] = {}


class _HeaderView(Mapping[str, str]):
    """The router's view of a request's headers: lower-case name -> first value, decoded on access."""

    __slots__ = ("_index",)

    def __init__(self, index: dict[bytes, bytes]) -> None:
        self._index = index

    def get(self, key: str, default: Any = None) -> Any:
        k = _KEYS.get(key)
        if k is None:
            k = key.lower().encode("utf-8", "surrogateescape")
            if len(_KEYS) < 256:  # keys come from the identity config: a handful
                _KEYS[key] = k
        value = self._index.get(k)
        return default if value is None else value.decode("utf-8", "surrogateescape")

    def __getitem__(self, key: str) -> str:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return str(value)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    def __iter__(self) -> Iterator[str]:
        return (k.decode("latin-1") for k in self._index)

    def __len__(self) -> int:
        return len(self._index)


class _ResponseHeaderView(Mapping[str, str]):
    """The router's view of a response head (a handful of headers): scanned on access only."""

    __slots__ = ("_headers", "_lows")

    def __init__(self, headers: list[tuple[bytes, bytes]], lows: list[bytes]) -> None:
        self._headers = headers
        self._lows = lows

    def get(self, key: str, default: Any = None) -> Any:
        k = key.lower().encode("utf-8", "surrogateescape")
        for (_, value), low in zip(self._headers, self._lows):
            if low == k:
                return value.decode("utf-8", "surrogateescape")
        return default

    def __getitem__(self, key: str) -> str:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return str(value)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(low.decode("latin-1") for low in self._lows))

    def __len__(self) -> int:
        return len(set(self._lows))


class FastEngine(Engine):
    """Reverse proxy on asyncio Protocols (uvloop in production) with llhttp parsing."""

    _server: asyncio.AbstractServer
    _port: int
    loop: asyncio.AbstractEventLoop

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.clients: set[_ClientConnection] = set()
        self.in_flight = 0
        self.draining = False
        self._drained: asyncio.Future[None] | None = None
        # upstream URL -> (pool, "Host: ...\r\n" line, base path bytes)
        self.upstreams: dict[str, tuple[UpstreamPool, bytes, bytes]] = {}
        self._pools: list[UpstreamPool] = []
        self._drop: dict[frozenset[str], frozenset[bytes]] = {}

    async def start(self) -> None:
        for dep in self.router.deployments:
            for up in dep.upstreams:
                if up.scheme != "http":
                    raise ConfigError(
                        f"deployment {dep.name!r}: upstream {up.url} is {up.scheme}; the fast engine forwards "
                        "plain HTTP/1.1 only (use engine: aiohttp for https upstreams)")
        self.loop = loop = asyncio.get_running_loop()
        limits: dict[tuple[str, int], int] = {}
        for dep in self.router.deployments:
            for up in dep.upstreams:
                key = (up.host, up.port)
                limits[key] = max(limits.get(key, 0), dep.limits.max_connections_per_upstream)
        pools: dict[tuple[str, int], UpstreamPool] = {}
        for dep in self.router.deployments:
            for up in dep.upstreams:
                key = (up.host, up.port)
                if key not in pools:
                    pools[key] = UpstreamPool(loop, up.host, up.port, limits[key])
                self.upstreams[up.url] = (pools[key], f"{h.HOST}: {up.host_header}\r\n".encode(),
                                          up.base_path.encode())
        self._pools = list(pools.values())
        listen = self.config.listen
        self._server = await loop.create_server(lambda: _ClientConnection(self), listen.host, listen.port,
                                                backlog=1024, reuse_address=True)
        self._port = int(self._server.sockets[0].getsockname()[1])

    @property
    def port(self) -> int:
        return self._port

    async def drain(self, grace: float) -> None:
        self.draining = True
        self._server.close()
        for client in list(self.clients):
            if not client.queue:
                client.close()
        if self.in_flight:
            self._drained = self.loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._drained), grace)
            except asyncio.TimeoutError:
                log.warning("drain grace expired with %d requests in flight", self.in_flight)

    async def close(self) -> None:
        self._server.close()
        for client in list(self.clients):
            client.abort_all()
        for pool in self._pools:
            pool.close()
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
            "in_flight": self.in_flight,
            "client_write_buffer": sum(c.transport.get_write_buffer_size() for c in self.clients),
            "upstream_write_buffer": up_buffered,
            "upstream_connections": sum(p.total for p in self._pools),
            "upstream_idle": sum(len(p.idle) for p in self._pools),
        }

    # -- used by connections and exchanges ------------------------------------------------

    def drop_for(self, strip: frozenset[str]) -> frozenset[bytes]:
        drop = self._drop.get(strip)
        if drop is None:
            drop = _REQ_DROP | {s.lower().encode() for s in strip}
            if len(self._drop) < 64:  # one per deployment in practice
                self._drop[strip] = drop
        return drop

    def request_started(self) -> None:
        self.in_flight += 1
        self.metrics.in_flight.inc()

    def request_done(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.dec()
        if self.in_flight == 0 and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)


class _ClientConnection(asyncio.Protocol):
    """One client connection: parses requests, answers them in order."""

    __slots__ = ("engine", "loop", "parser", "transport", "flow", "peer", "queue", "cur", "out",
                 "in_head", "head_fed", "head_bytes", "max_head", "stopped", "refusal", "write_paused",
                 "idle_since", "ka_timer", "closing", "advancing")

    def __init__(self, engine: FastEngine) -> None:
        self.engine = engine
        self.loop = engine.loop
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[_Exchange] = deque()
        self.cur: _Exchange | None = None  # the request being parsed
        self.out: list[bytes] = []  # bytes for the client, written once per event
        self.in_head = False
        self.head_fed = 0
        self.head_bytes = 0
        self.max_head = engine.config.limits.max_header_bytes
        self.stopped = False
        self.refusal: tuple[errors.ProxyError, str] | None = None
        self.write_paused = False
        self.closing = False
        self.advancing = False

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.flow = ReadFlow(transport)
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]).encode() if peer else b""
        self.engine.clients.add(self)
        self.idle_since = self.loop.time()
        self.ka_timer = self.loop.call_later(KEEPALIVE_TIMEOUT, self._keepalive_check)

    def data_received(self, data: bytes) -> None:
        if self.stopped:
            return
        if self.in_head:
            self.head_fed += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._stop()  # the upgrade/CONNECT request is queued and refused; nothing after it is read
        except httptools.HttpParserError as exc:
            refusal = self.refusal
            if refusal is None:
                if isinstance(exc, httptools.HttpParserCallbackError):
                    log.error("request parser callback failed", exc_info=exc.__context__)
                refusal = (_bad_request(f"malformed request: {exc}"), "bad_request")
            self._refuse(*refusal)
        else:
            if self.in_head and self.head_fed > self.max_head:
                # llhttp holds a partial header line until it ends: bound what it can hold.
                self._refuse(_headers_too_large(self.max_head), "headers_too_large")
        self.advance()

    def eof_received(self) -> bool | None:
        return None  # the client is gone: close (connection_lost aborts what is in flight)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.stopped = True
        self.engine.clients.discard(self)
        self.ka_timer.cancel()
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

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.cur = _Exchange(self)
        self.in_head = True
        self.head_fed = 0
        self.head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self.head_bytes += len(url)
        if self.head_bytes > self.max_head:
            self.refusal = (_headers_too_large(self.max_head), "headers_too_large")
            raise _Refused
        ex = self.cur
        assert ex is not None
        ex.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > self.max_head:
            self.refusal = (_headers_too_large(self.max_head), "headers_too_large")
            raise _Refused
        if self.in_head:
            ex = self.cur
            assert ex is not None
            low = name.lower()
            ex.headers.append((name, low, value))
            if low not in ex.index:
                ex.index[low] = value
        # else: a trailer after a chunked body: counted against the limit, never forwarded

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.head_bytes = 0  # trailers get a budget of their own
        ex = self.cur
        assert ex is not None
        parser = self.parser
        ex.method = parser.get_method()
        ex.keep_alive = parser.should_keep_alive()
        ex.check_head(parser.get_http_version())
        ex.queued = True
        queue = self.queue
        queue.append(ex)
        if ex.error is not None:
            self._stop()  # answered, then closed: later bytes are never read as requests
        elif len(queue) > 1:
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
            try:
                queue = self.queue
                while queue:
                    ex = queue[0]
                    if ex.state == QUEUED:
                        try:
                            ex.start()
                        except Exception as exc:  # a bug must cost one request, not the listener
                            log.error("request failed in the engine: %r", exc, exc_info=exc)
                            ex.internal_error()
                        continue
                    ex.pump()
                    break
            finally:
                self.advancing = False
            if len(self.queue) <= 1:
                self.flow.resume(PIPELINED)
        self.flush()

    def done(self, ex: _Exchange) -> None:
        """``ex`` is answered (or abandoned by us): move on to the next request or close."""
        queue = self.queue
        if queue and queue[0] is ex:
            queue.popleft()
        self.engine.request_done()
        if ex.close_after or self.engine.draining:
            self.close()
            return
        if not queue:
            self.idle_since = self.loop.time()
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
        self.ka_timer.cancel()
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
        self.ka_timer.cancel()
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

    def _keepalive_check(self) -> None:
        if self.closing:
            return
        delay = KEEPALIVE_TIMEOUT
        if not self.queue:
            idle = self.loop.time() - self.idle_since
            if idle >= KEEPALIVE_TIMEOUT:
                self.close()
                return
            delay -= idle
        self.ka_timer = self.loop.call_later(delay, self._keepalive_check)


def _headers_too_large(limit: int) -> errors.ProxyError:
    return errors.ProxyError(errors.HEADERS_TOO_LARGE, f"request head exceeds {limit} bytes", limit=limit)


class _Exchange:
    """One request/response: routed, forwarded, relayed, finished exactly once."""

    __slots__ = ("client", "method", "target", "headers", "index", "http10", "keep_alive", "length",
                 "chunked", "expect", "conn_tokens", "error", "queued", "body", "body_size", "complete",
                 "state", "started", "decision", "t0", "limit", "head", "frame_chunked", "pool", "conn",
                 "connect_timeout", "idle_timeout", "timer", "last_io", "request_sent", "resp_started",
                 "resp_status", "resp_mode", "close_after")

    def __init__(self, client: _ClientConnection) -> None:
        self.client = client
        self.method = b""
        self.target = b""
        self.headers: list[tuple[bytes, bytes, bytes]] = []  # (name, lower-case name, value)
        self.index: dict[bytes, bytes] = {}  # lower-case name -> first value
        self.http10 = False
        self.keep_alive = False
        self.length = -1  # declared Content-Length
        self.chunked = False
        self.expect = False
        self.conn_tokens: set[bytes] | frozenset[bytes] = frozenset()
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
        self.head = b""
        self.frame_chunked = False
        self.pool: UpstreamPool | None = None
        self.conn: UpstreamConnection | None = None
        self.connect_timeout = 0.0
        self.idle_timeout = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.last_io = 0.0
        self.request_sent = False
        self.resp_started = False
        self.resp_status = 0
        self.resp_mode = R_NONE
        self.close_after = False

    # -- request head -------------------------------------------------------------------------

    def check_head(self, version: str) -> None:
        """Framing and form checks llhttp leaves to the application (run at end of head)."""
        index = self.index
        self.http10 = version == "1.0"
        if version != "1.1" and not self.http10:
            self.error = (_bad_request(f"unsupported HTTP version {version}"), "bad_request")
            return
        if _CONNECTION in index:
            self.conn_tokens = _tokens(v for _, low, v in self.headers if low == _CONNECTION)
        te = index.get(_TRANSFER_ENCODING)
        if te is not None:
            count = sum(1 for _, low, _ in self.headers if low == _TRANSFER_ENCODING)
            if self.http10 or count > 1 or te.strip().lower() != b"chunked":
                self.error = (_bad_request("unsupported Transfer-Encoding (only chunked, on HTTP/1.1)"),
                              "bad_request")
                return
            self.chunked = True
        cl = index.get(_CONTENT_LENGTH)
        if cl is not None:
            self.length = int(cl)  # llhttp accepted exactly one, all digits
        if _UPGRADE in index and b"upgrade" in self.conn_tokens:
            self.error = (errors.ProxyError(errors.UPGRADE_NOT_SUPPORTED,
                                            "the sidecar does not proxy protocol upgrades"), "upgrade")
            return
        if self.method == b"CONNECT" or not self.target.startswith(b"/"):
            self.error = (_bad_request("request target must be an absolute path (origin-form)"), "bad_request")
            return
        expect = index.get(_EXPECT)
        self.expect = expect is not None and expect.lower() == b"100-continue"

    # -- request path -------------------------------------------------------------------------

    def start(self) -> None:
        client = self.client
        engine = client.engine
        self.started = True
        self.state = BUFFERING
        engine.request_started()
        router = engine.router
        if self.error is not None:
            exc, reason = self.error
            self.respond_error(exc, router.default.name, router.default.mode_name, reason, close=True)
            return
        self.t0 = perf_counter()
        try:
            decision = router.route(RequestHead(self.method.decode("latin-1"),
                                                self.target.decode("utf-8", "surrogateescape"),
                                                _HeaderView(self.index)))
        except errors.ProxyError as exc:
            self.respond_error(exc, router.default.name, router.default.mode_name, exc.type)
            return
        self.decision = decision
        dep = decision.deployment
        self.limit = limit = decision.max_body_bytes
        if self.length > limit or self.body_size > limit:
            router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
            # A declared length whose body is already parsed leaves nothing to skip: keep the
            # connection. A chunked body over the limit, or one still arriving, ends it.
            self.respond_error(_too_large(dep.name, limit), dep.name, dep.mode_name, "body_too_large",
                               close=self.chunked or not self.complete)
            return
        if self.expect and not self.complete and not self.http10:
            client.out.append(_CONTINUE)
        if decision.needs_body:
            if self.complete:
                self._send_transformed()
            return
        self.head = self._build_head(decision, -1)
        self._acquire()

    def pump(self) -> None:
        """Client bytes were parsed: forward, buffer or refuse them according to the state."""
        state = self.state
        if state >= SENT:
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
                assert self.conn is not None
                self.conn.send(b"".join(out))
                self.last_io = self.client.loop.time()
        elif state == BUFFERING:
            if self.complete:
                self._send_transformed()
        elif state == CONNECTING and self.body_size > WAIT_BUFFER and not self.complete:
            self.client.flow.pause(WAITING)

    def _send_transformed(self) -> None:
        decision = self.decision
        assert decision is not None
        body = self.body
        raw = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        try:
            new = self.client.engine.router.transform_body(decision, raw)
        except errors.ProxyError as exc:
            self.client.engine.router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
            dep = decision.deployment
            self.respond_error(exc, dep.name, dep.mode_name, exc.type)
            return
        self.head = self._build_head(decision, len(new))
        if new:
            body.append(new)
        self._acquire()

    def _build_head(self, decision: Decision, length: int) -> bytes:
        """The upstream request head; ``length >= 0`` replaces the body framing (transformed body)."""
        client = self.client
        engine = client.engine
        pool, host_line, base = engine.upstreams[decision.upstream.url]
        self.pool = pool
        index = self.index
        drop = engine.drop_for(decision.strip)
        if self.conn_tokens:
            drop = drop | self.conn_tokens
        add = decision.add
        if add:
            names = frozenset(n.lower().encode() for n, _ in add)
            if not names <= drop:
                drop = drop | names  # the mode's value replaces a client header of the same name
        if length >= 0 and _CONTENT_LENGTH in index:
            drop = drop | {_CONTENT_LENGTH}
        parts = [self.method, b" ", base, self.target, b" HTTP/1.1\r\n", host_line]
        for name, low, value in self.headers:
            if low not in drop:
                parts += (name, b": ", value, b"\r\n")
        xff = index.get(_XFF)
        if xff is not None:
            if _XFF in self.conn_tokens or _XFF_STR in decision.strip:
                xff = None  # the client's value is dropped, not extended
            else:
                values = [v for _, low, v in self.headers if low == _XFF]
                if len(values) > 1:
                    xff = b", ".join(values)
        parts += (_XFF_LINE, xff + b", " + client.peer if xff else client.peer, b"\r\n")
        if _XFP not in index or _XFP in drop:
            parts.append(_XFP_LINE)
        for name, value in add:
            parts += (name.encode("latin-1"), b": ", value.encode("utf-8", "surrogateescape"), b"\r\n")
        self.frame_chunked = False
        if length >= 0:
            parts += (_CL_LINE, b"%d" % length, b"\r\n")
        elif self.chunked:
            parts.append(_CHUNKED_LINE)
            self.frame_chunked = True
        elif self.length < 0 and self.method not in _NO_EMPTY_LENGTH:
            parts += (_CL_LINE, b"0\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def _acquire(self) -> None:
        decision = self.decision
        assert decision is not None and self.pool is not None
        client = self.client
        dep = decision.deployment
        t = dep.timeouts
        client.engine.metrics.added_hist(dep.name).observe(perf_counter() - self.t0)
        self.state = CONNECTING
        self.connect_timeout = t.connect
        self.idle_timeout = t.idle
        # Like the aiohttp client's sock_read, silence before the head is bounded by `idle` too.
        self.timer = client.loop.call_later(min(t.first_byte, t.idle), self._first_byte_timeout)
        self.pool.acquire(self)
        if self.state == CONNECTING and self.body_size > WAIT_BUFFER and not self.complete:
            client.flow.pause(WAITING)

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

    @property
    def client_write_paused(self) -> bool:
        return self.client.write_paused

    def attach(self, conn: UpstreamConnection) -> None:
        self.conn = conn
        conn.bind(self)
        self.client.flow.resume(WAITING)
        out = [self.head]
        self.head = b""
        if self.body:
            self._frame_body(out)
        if self.complete:
            if self.frame_chunked:
                out.append(_LAST_CHUNK)
            self.state = SENT
            self.request_sent = True
        else:
            self.state = SENDING
        conn.send(b"".join(out))

    def connect_failed(self, kind: str, exc: BaseException) -> None:
        if self.state != CONNECTING:
            return
        decision = self.decision
        assert decision is not None
        dep, up = decision.deployment, decision.upstream
        if kind == "timeout":
            self._upstream_error("timeout", errors.UPSTREAM_TIMEOUT,
                                 f"upstream of deployment {dep.name!r} ({up.url}) timed out")
        else:
            self.client.engine.router.upstream_unreachable(decision)  # nothing was sent: fail the tree over
            self._upstream_error("connect", errors.UPSTREAM_UNREACHABLE,
                                 f"upstream of deployment {dep.name!r} ({up.url}) is unreachable: {exc}")

    def peer_full(self, full: bool) -> None:
        if full:
            self.client.flow.pause(PEER_FULL)
        else:
            self.client.flow.resume(PEER_FULL)

    def response_head(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> int:
        timer = self.timer
        if timer is not None:
            timer.cancel()
            self.timer = None
        client = self.client
        engine = client.engine
        decision = self.decision
        assert decision is not None
        dep = decision.deployment
        engine.health.mark_reached()
        engine.metrics.ttfb_hist(dep.name, dep.mode_name).observe(perf_counter() - self.t0)
        self.resp_status = status
        self.resp_started = True
        lows = [name.lower() for name, _ in headers]
        engine.router.on_response(decision, status, _ResponseHeaderView(headers, lows))
        drop = _HOP
        if _CONNECTION in lows:
            drop = _HOP | _tokens(v for (_, v), low in zip(headers, lows) if low == _CONNECTION)
        body = BODY_FRAMED
        if self.method == b"HEAD":
            mode = R_NONE
            body = BODY_NONE
        elif status == 204 or status == 304:
            mode = R_NONE
        elif _TRANSFER_ENCODING not in lows and _CONTENT_LENGTH in lows:
            mode = R_LENGTH
        else:
            if _TRANSFER_ENCODING in lows:
                codings = b",".join(v for (_, v), low in zip(headers, lows) if low == _TRANSFER_ENCODING)
                if codings.rsplit(b",", 1)[-1].strip().lower() != b"chunked":
                    body = BODY_UNTIL_EOF
            else:
                body = BODY_UNTIL_EOF
            mode = R_CLOSE if self.http10 else R_CHUNKED
        keep = self.keep_alive and self.complete and mode != R_CLOSE and not engine.draining
        parts = [b"HTTP/1.0 " if self.http10 else b"HTTP/1.1 ", _STATUS_CODE.get(status) or b"%d" % status,
                 b" ", reason, b"\r\n"]
        for (name, value), low in zip(headers, lows):
            if low not in drop:
                parts += (name, b": ", value, b"\r\n")
        if mode == R_CHUNKED:
            parts.append(_CHUNKED_LINE)
        if not keep:
            if not self.http10:  # closing is HTTP/1.0's default
                parts.append(_CLOSE_LINE)
            self.close_after = True
        elif self.http10:
            parts.append(_KEEPALIVE_LINE)
        parts.append(b"\r\n")
        client.out.append(b"".join(parts))
        self.resp_mode = mode
        return body

    def response_body(self, data: bytes) -> None:
        mode = self.resp_mode
        if mode == R_CHUNKED:
            self.client.out += (b"%x\r\n" % len(data), data, b"\r\n")
        elif mode != R_NONE:
            self.client.out.append(data)

    def flush(self) -> None:
        """Part of the response was relayed: write it, and watch for an idle upstream from now on."""
        self.client.flush()
        if self.timer is None and self.state != DONE:
            self.timer = self.client.loop.call_later(self.idle_timeout, self._idle_check)

    def response_end(self) -> None:
        client = self.client
        if self.resp_mode == R_CHUNKED:
            client.out.append(_LAST_CHUNK)
        client.flush()  # the last byte is on its way before the router hears the turn ended
        self.conn = None
        self.state = DONE
        timer = self.timer
        if timer is not None:
            timer.cancel()
            self.timer = None
        engine = client.engine
        decision = self.decision
        assert decision is not None
        dep = decision.deployment
        status = self.resp_status
        m = engine.metrics
        m.request_counter(dep.name, dep.mode_name, f"{status // 100}xx").inc()
        m.duration_hist(dep.name, dep.mode_name).observe(perf_counter() - self.t0)
        engine.router.finish(decision, TurnOutcome.COMPLETED if status < 500 else TurnOutcome.UPSTREAM_FAILED)
        if not self.complete:
            self.close_after = True  # the rest of the request body is never read
        client.done(self)

    def upstream_failed(self, message: str) -> None:
        """The upstream connection failed (it has detached itself)."""
        self.conn = None
        if self.state == DONE:
            return
        decision = self.decision
        assert decision is not None
        dep, up = decision.deployment, decision.upstream
        if not self.resp_started:
            self._upstream_error("protocol", errors.UPSTREAM_PROTOCOL_ERROR,
                                 f"upstream of deployment {dep.name!r} ({up.url}) failed: {message}")
            return
        # Mid-response: the status line is gone, the only honest signal left is an incomplete
        # response (aborted connection) rather than a clean end.
        self.client.engine.metrics.upstream_error(dep.name, "reset").inc()
        self.client.engine.router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
        log.warning("upstream failed mid-response: %s", message, extra={"deployment": dep.name})
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
        keep = not close and self.keep_alive and self.complete and not engine.draining
        parts = [b"HTTP/1.0 " if self.http10 else b"HTTP/1.1 ",
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
            self.client.engine.router.finish(self.decision, TurnOutcome.UPSTREAM_FAILED)
        d = self.client.engine.router.default
        exc = errors.ProxyError(errors.INTERNAL_ERROR, "the sidecar failed to handle this request")
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
        self._fail_started(_too_large(dep.name, self.limit), "body_too_large")

    def _fail_started(self, exc: errors.ProxyError, reason: str) -> None:
        decision = self.decision
        assert decision is not None
        dep = decision.deployment
        self.client.engine.router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
        if self.resp_started:
            self._abort_client()
        else:
            self.respond_error(exc, dep.name, dep.mode_name, reason, close=True)

    def _upstream_error(self, kind: str, type_: str, message: str) -> None:
        decision = self.decision
        assert decision is not None
        dep = decision.deployment
        engine = self.client.engine
        engine.metrics.upstream_error(dep.name, kind).inc()
        engine.router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
        exc = errors.ProxyError(type_, message, deployment=dep.name, upstream=decision.upstream.url)
        self.respond_error(exc, dep.name, dep.mode_name, None)

    def _first_byte_timeout(self) -> None:
        self.timer = None
        if self.state in (CONNECTING, SENDING, SENT) and not self.resp_started:
            decision = self.decision
            assert decision is not None
            dep, up = decision.deployment, decision.upstream
            self._upstream_error("timeout", errors.UPSTREAM_TIMEOUT,
                                 f"upstream of deployment {dep.name!r} ({up.url}) timed out")

    def _idle_check(self) -> None:
        self.timer = None
        if self.state == DONE:
            return
        loop = self.client.loop
        silent = loop.time() - self.last_io
        if silent < self.idle_timeout:
            self.timer = loop.call_later(self.idle_timeout - silent, self._idle_check)
            return
        decision = self.decision
        assert decision is not None
        dep = decision.deployment
        engine = self.client.engine
        engine.metrics.upstream_error(dep.name, "timeout").inc()
        engine.router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
        log.warning("upstream idle for %.1fs mid-response", silent, extra={"deployment": dep.name})
        self._abort_client()

    def _release_upstream(self) -> None:
        timer = self.timer
        if timer is not None:
            timer.cancel()
            self.timer = None
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
        client.engine.request_done()
        client.abort()

    def client_gone(self) -> None:
        """The client connection closed: abandon the upstream side (an abandoned stream must not keep a GPU busy)."""
        if not self.started or self.state == DONE:
            return
        self.state = DONE
        self._release_upstream()
        engine = self.client.engine
        if self.decision is not None:
            engine.router.finish(self.decision, TurnOutcome.CLIENT_ABORTED)
        engine.request_done()

