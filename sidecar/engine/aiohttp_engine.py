"""The reference engine: aiohttp's low-level server and one pooled ``ClientSession``.

Slower than the protocol-level engine but built entirely on aiohttp's well-tested HTTP code;
the proxy test suite runs against both. What it adds to aiohttp, in :class:`_Connection` (one per
client connection) and module helpers: a request head must complete within
``head_timeout_seconds`` (408), malformed requests are answered in the JSON error format and
logged without their bytes, and header bytes that are not UTF-8 travel unchanged in both
directions (:func:`_install_raw_header_serializer`).
"""

from __future__ import annotations

import asyncio
import io
import logging
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import aiohttp
from aiohttp import http_writer, web, web_protocol
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.streams import EMPTY_PAYLOAD
from multidict import CIMultiDict
from yarl import URL

from sidecar import errors
from sidecar import headers as h
from sidecar.context import TurnOutcome
from sidecar.engine.base import Engine
from sidecar.engine.parse_errors import UNSUPPORTED_CODING
from sidecar.engine.request_rules import check, host_bits, lone_chunked, version_refusal
from sidecar.engine.wire import error_response
from sidecar.errors import failure_reason
from sidecar.router import BODY, LOAD, REFUSED, WORK, Admission, Decision, RequestHead, body_pool
from sidecar.tls import refused_after_handshake
from sidecar.usage import LAST_BYTES, TAIL_READS, UsageReader

log = logging.getLogger("sidecar.engine")

# A buffered body above this size goes upstream from a stream (aiohttp's own threshold).
_LARGE_BODY = 1 << 20
_SKIP_AUTO = frozenset({"User-Agent", "Accept", "Accept-Encoding", "Content-Type"})
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# An idle keep-alive client connection is closed after this long, and unread request bytes are
# read and discarded for at most this long after an answer before closing (as the fast engine does).
KEEPALIVE_TIMEOUT = 75.0
LINGER_SECONDS = 2.0
# How long close() lets aiohttp wait for a request still in flight, then again once it cancelled
# it: drain() already gave requests the grace (aiohttp's own default, 60 s twice, would hold the
# process for two minutes past drain_grace_seconds, behind an upstream that never answers).
CLOSE_TIMEOUT = 0.5


class _TooLarge(Exception):
    pass


class _ClientTimeout(Exception):
    """The client stopped sending a request body it had begun."""


class _UpstreamCut(Exception):
    """The upstream failed mid-response; it is counted and logged (rate-limited) and the client
    connection aborted: aiohttp has nothing left to answer or log."""


def _install_raw_header_serializer() -> None:
    """Make aiohttp's writer send header bytes exactly as they were received.

    aiohttp's parsers decode header bytes as UTF-8 with ``surrogateescape``; its C serializer then
    drops the lone surrogates that bytes which are not UTF-8 became, so such a header reached the
    upstream altered. This serializer (aiohttp's own pure-Python one, encoding with
    ``surrogateescape``) turns them back into the original bytes; it keeps aiohttp's refusal of
    control characters (header injection)."""
    if getattr(http_writer._serialize_headers, "raw_bytes", False):
        return

    def serialize(status_line: str, headers: CIMultiDict[str]) -> bytes:
        safe = http_writer._safe_header
        lines = "\r\n".join(safe(k) + ": " + safe(v) for k, v in headers.items())
        return (safe(status_line) + "\r\n" + lines + "\r\n\r\n").encode("utf-8", "surrogateescape")

    serialize.raw_bytes = True  # type: ignore[attr-defined]
    http_writer._serialize_headers = serialize


class _Connection(web_protocol.RequestHandler):
    """aiohttp's handler of one client connection, with a head timeout and quiet, JSON refusals."""

    __slots__ = ("_head_timer", "_head_timeout", "_on_refused", "_line")

    def __init__(self, manager: Any, *, head_timeout: float, on_refused: Any, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_timeout = head_timeout
        self._on_refused = on_refused  # counts a refusal: on_refused(reason)
        # The bytes of the next head's request line while they are known to start it: at the
        # connection's start, and after a read that ended with a whole request without a body.
        # None once that line ended (or where a head starts is not known).
        self._line: bytes | None = b""

    def data_received(self, data: bytes) -> None:
        line = self._line
        if line is not None and self._request_line_without_version(line + data):
            return
        messages = len(self._messages)
        super().data_received(data)
        if len(self._messages) > messages:  # (aiohttp queues what it parsed; its task takes it later)
            ended = data.endswith(b"\r\n\r\n") and self._messages[-1][1] is EMPTY_PAYLOAD
            self._line = b"" if ended else None
        # Bytes that complete no request while none is being handled: a head in progress. It
        # must complete within the head timeout (a head dribbled byte by byte holds a
        # connection and a parser buffer for as long as it lasts).
        waiting = self._current_request is None and not self._messages
        if waiting and data and self._head_timer is None and not (self._force_close or self._close):
            self._head_timer = self._loop.call_later(self._head_timeout, self._head_expired)
        elif not waiting and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _request_line_without_version(self, line: bytes) -> bool:
        """Watch a request line (``line``: its bytes so far): one that ended without an HTTP
        version, or with 0.9, is refused now, as the fast engine does (aiohttp would read header
        lines until an empty line that an HTTP/0.9 client never sends)."""
        line = line.lstrip(b"\r\n")  # (empty lines before a request are skipped)
        end = line.find(b"\n")
        if end < 0:
            self._line = line if len(line) <= self.max_line_size else None
            return False
        self._line = None
        method, _, rest = line[:end].rstrip(b"\r").partition(b" ")
        target, space, version = rest.partition(b" ")
        if not method or not target or (space and version != b"HTTP/0.9"):
            return False  # a version (or not a request line: the parser's to judge)
        self._refuse_head(*version_refusal(9))
        return True

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport is None or self._current_request is not None or self._messages:
            return
        self._refuse_head(
            errors.request_timeout(f"the request head did not arrive within {self._head_timeout:g} s"),
            "request_timeout",
        )

    def _refuse_head(self, exc: errors.ProxyError, reason: str) -> None:
        """Answer a head that will never be served, as the fast engine does, and close."""
        self._on_refused(reason)
        if self.transport is not None:
            self.transport.write(error_response(exc, http10=False, keep_alive=False, head_only=False))
        self.force_close()

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """Answer in the JSON error format. A malformed request is logged without its bytes
        (aiohttp's message quotes them: headers, bearer tokens); a failure of the sidecar's own
        handler keeps its traceback."""
        if isinstance(exc, _UpstreamCut):
            log.debug("response cut: the upstream failed mid-response")
            err = errors.internal_error()  # never sent: the connection is aborted
        elif isinstance(exc, HttpProcessingError):
            log.debug("refused a malformed request: %s", type(exc).__name__)
            if isinstance(exc, LineTooLong):
                err = errors.headers_too_large(self.max_field_size)
            else:
                err = errors.bad_request(f"malformed request ({type(exc).__name__})")
            self._on_refused(err.type)
        elif status >= 500:
            log.error("request handling failed: %s", type(exc).__name__ if exc else status, exc_info=exc)
            err = errors.internal_error()
        else:
            err = errors.ProxyError(errors.BAD_REQUEST, message or "bad request", status=status)
        resp = web.Response(status=err.status, body=err.body(), content_type="application/json")
        resp.force_close()
        return resp


class _UpstreamProtocol(ResponseHandler):
    """aiohttp's protocol of an upstream connection, which also tells a TLS session the upstream
    refused after the handshake without an alert (:func:`sidecar.tls.refused_after_handshake`)
    from a close: the close becomes that refusal, an ``ssl.SSLError`` as an alert would be."""

    answered = False  # a response head arrived on this connection

    def feed_data(self, data: Any, size: int = 0) -> None:
        # Called once per response head (its body goes to the response's own stream).
        self.answered = True
        super().feed_data(data, size)

    def connection_lost(self, exc: BaseException | None) -> None:
        # (``transport`` is None after the sidecar's own close or abort: never a refusal.)
        if not self.answered and not isinstance(exc, ssl.SSLError):
            refusal = refused_after_handshake(self.transport)
            if refusal is not None:
                exc = refusal
        super().connection_lost(exc)


class _Server(web.Server):
    """``web.Server`` whose connections are :class:`_Connection`."""

    def __init__(self, handler: Any, *, head_timeout: float, on_refused: Any, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._head_timeout = head_timeout
        self._on_refused = on_refused

    def __call__(self) -> web_protocol.RequestHandler:
        return _Connection(
            self, loop=self._loop, head_timeout=self._head_timeout, on_refused=self._on_refused, **self._kwargs
        )


class AiohttpEngine(Engine):
    """Reverse proxy on ``aiohttp.web.Server`` + ``aiohttp.ClientSession``."""

    _runner: web.ServerRunner
    _site: web.TCPSite
    _session: aiohttp.ClientSession

    async def start(self) -> None:
        _install_raw_header_serializer()
        deps = self.router.deployments
        limit = max(d.limits.max_connections_per_upstream for d in deps)
        head_cap = max(d.limits.max_header_bytes for d in deps)
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=limit, enable_cleanup_closed=False)
        # aiohttp has no public hook for the protocol of its connections; this is the factory
        # every one of them comes from.
        connector._factory = partial(_UpstreamProtocol, loop=asyncio.get_running_loop())  # type: ignore[assignment]
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None),
            max_line_size=head_cap,
            max_field_size=head_cap,
        )
        self._body_pool = body_pool()  # an admission's body work (large bodies)
        self._in_flight = 0
        self._keepalive = True  # off from the start of shutdown: every answer closes its connection
        self._idle = asyncio.Event()
        self._idle.set()
        server = _Server(
            self._handle,
            head_timeout=self.config.head_timeout_seconds,
            on_refused=lambda reason: self.metrics.rejected.labels(reason).inc(),
            handler_cancellation=True,
            keepalive_timeout=KEEPALIVE_TIMEOUT,
            lingering_time=LINGER_SECONDS,
            max_field_size=self.config.limits.max_header_bytes,
            max_line_size=self.config.limits.max_header_bytes,
        )
        self._runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=CLOSE_TIMEOUT)
        await self._runner.setup()
        self._site = web.TCPSite(
            self._runner, self.config.listen.host, self.config.listen.port, backlog=1024, reuse_address=True
        )
        await self._site.start()

    @property
    def port(self) -> int:
        return int(self._runner.addresses[0][1])

    def stop_keepalive(self) -> None:
        self._keepalive = False

    async def drain(self, grace: float) -> None:
        self._keepalive = False
        await self._site.stop()
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            log.warning("drain grace expired with %d requests in flight", self._in_flight)

    async def close(self) -> None:
        await self._runner.cleanup()
        await self._session.close()
        self._body_pool.shutdown(wait=False, cancel_futures=True)

    # -- request path -------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        t0 = time.perf_counter()
        self._in_flight += 1
        self._idle.clear()
        self.metrics.in_flight.inc()
        try:
            return await self._proxy(request, t0)
        finally:
            self._in_flight -= 1
            self.metrics.in_flight.dec()
            if self._in_flight == 0:
                self._idle.set()

    def _error(self, exc: errors.ProxyError, dep_name: str, mode: str, reason: str | None = None) -> web.Response:
        self.metrics.request_counter(dep_name, mode, f"{exc.status // 100}xx").inc()
        if reason:
            self.metrics.rejected.labels(reason).inc()
        resp = web.Response(status=exc.status, body=exc.body(), content_type="application/json")
        if not self._keepalive:
            resp.force_close()
        return resp

    def _refuse(self, request: web.BaseRequest, exc: errors.ProxyError, reason: str) -> web.Response:
        """Answer a request whose stream cannot be trusted any further, and close."""
        router = self.router
        if request.version < (1, 0):
            # aiohttp answers in the request's version; an HTTP/0.9 client gets an HTTP/1.0 status line.
            request._message = request._message._replace(version=aiohttp.HttpVersion10)
        resp = self._error(exc, router.default.name, router.default.mode_name, reason)
        resp.force_close()
        return resp

    async def _proxy(self, request: web.BaseRequest, t0: float) -> web.StreamResponse:
        router = self.router
        in_headers = request.headers
        upgrade = h.UPGRADE in in_headers and "upgrade" in h.connection_tokens(in_headers.getall(h.CONNECTION, ()))
        raw_target, refusal = check(  # (the request-head rules: sidecar.engine.request_rules)
            10 * request.version[0] + request.version[1],
            host_bits(_raw(in_headers.getall(h.HOST, []))),
            _raw(in_headers.getall(h.TRANSFER_ENCODING, [])),
            upgrade,
            request.method.encode("latin-1"),
            request.raw_path.encode("utf-8", "surrogateescape"),
        )
        if refusal is not None:
            return self._refuse(request, *refusal)
        target = raw_target.decode("utf-8", "surrogateescape")
        adm = router.admit(RequestHead(request.method, in_headers, raw_target))
        try:
            await self._settle(adm)  # a session this replica does not hold: ask the shared store
            if adm.need == REFUSED:
                return self._refused(adm)
            dep = adm.deployment
            limit = adm.limit
            declared = request.content_length
            if declared is not None and declared > limit:
                return self._too_large(adm)
            body: bytes | io.BytesIO | AsyncIterator[bytes] | None = None
            if request.method not in ("GET", "HEAD") or request.body_exists:
                if in_headers.get(h.EXPECT, "").lower() == "100-continue":
                    await request.writer.write(_CONTINUE)
                if adm.need == BODY:
                    try:
                        chunks, size = await _read_bounded(request, limit, dep.timeouts.idle)
                        adm.body(chunks[0] if len(chunks) == 1 else chunks, size)
                        await self._settle(adm)  # (body work off the loop, a session the body names)
                    except _TooLarge:
                        return self._too_large(adm)
                    except _ClientTimeout:
                        adm.finish(TurnOutcome.CLIENT_ABORTED)
                        resp = self._error(
                            errors.request_timeout(f"the request body stalled for {dep.timeouts.idle:g} s"),
                            dep.name,
                            dep.mode_name,
                            errors.REQUEST_TIMEOUT,
                        )
                        resp.force_close()
                        return resp
                    except Exception as exc:  # a defect: still finish the turn and answer
                        log.error("request body handling failed: %r", exc, exc_info=exc, extra=adm.log_fields())
                        adm.finish(TurnOutcome.UPSTREAM_FAILED)
                        return self._error(errors.internal_error(), dep.name, dep.mode_name)
                    if adm.need == REFUSED:
                        return self._refused(adm)
                    assert adm.decision is not None
                    body = adm.decision.body
                elif request.body_exists:
                    body = _stream_bounded(request, limit)
        except asyncio.CancelledError:  # the client left
            adm.finish(TurnOutcome.CLIENT_ABORTED)
            raise
        decision = adm.decision
        assert decision is not None
        out = _forward_headers(decision, request)
        # The framing, from what the parser found (never from the client's header lines): a
        # rewritten body's length, the declared length, or chunked (the client's default for a
        # streamed body without a length).
        if isinstance(body, bytes):
            out[h.CONTENT_LENGTH] = str(len(body))
            if len(body) > _LARGE_BODY:
                body = io.BytesIO(body)  # written in pieces (aiohttp warns about one large write)
        elif request.content_length is not None and not request.headers.get(h.TRANSFER_ENCODING):
            out[h.CONTENT_LENGTH] = str(request.content_length)
        return await self._exchange(request, target, adm, decision, out, body, t0)

    async def _settle(self, adm: Admission) -> None:
        """Bring the admission what it needs (a session loaded from the shared store, body work
        run on a worker thread) until it needs the body, decided or refused."""
        while True:
            if adm.need == LOAD:
                assert adm.identity is not None
                await self.router.state.load(adm.identity)
                adm.loaded()
            elif adm.need == WORK:
                assert adm.work is not None
                adm.worked(await asyncio.get_running_loop().run_in_executor(self._body_pool, adm.work))
            else:
                return

    def _too_large(self, adm: Admission) -> web.Response:
        """A body above the admission's limit (of a body the sidecar parses while it needs it)."""
        adm.finish(TurnOutcome.UPSTREAM_FAILED)
        dep = adm.deployment
        return self._error(adm.too_large(), dep.name, dep.mode_name, "body_too_large")

    def _refused(self, adm: Admission) -> web.Response:
        """Answer what the router refused (a defect: 500)."""
        assert adm.error is not None
        dep = adm.deployment
        return self._error(adm.error, dep.name, dep.mode_name, adm.reason)

    async def _exchange(
        self,
        request: web.BaseRequest,
        target: str,
        adm: Admission,
        decision: Decision,
        out: CIMultiDict[str],
        body: bytes | io.BytesIO | AsyncIterator[bytes] | None,
        t0: float,
    ) -> web.StreamResponse:
        dep = decision.deployment
        up = decision.upstream
        m = self.metrics
        t = dep.timeouts
        url = URL(up.url + target, encoded=True)
        m.added_hist(dep.name).observe(time.perf_counter() - t0)
        resp: web.StreamResponse | None = None
        try:
            async with asyncio.timeout(t.first_byte):
                upstream = await self._session.request(
                    request.method,
                    url,
                    headers=out,
                    data=body,
                    allow_redirects=False,
                    skip_auto_headers=_SKIP_AUTO,
                    compress=None,
                    chunked=None,
                    timeout=aiohttp.ClientTimeout(total=None, connect=t.connect, sock_read=t.idle),
                    # The deployment's TLS context; it is part of the pool key, like the server name.
                    ssl=up.tls_context or True,
                    server_hostname=up.server_hostname,
                )
        except _TooLarge:
            return self._too_large(adm)
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            connecting = isinstance(exc, aiohttp.ConnectionTimeoutError)
            reason = (
                "connect timed out"
                if connecting
                else f"no response data for {t.idle:g} s"
                if isinstance(exc, aiohttp.SocketTimeoutError)
                else f"no response within {t.first_byte:g} s"
            )
            return self._upstream_failed(adm, "timeout", reason, connecting=connecting)
        except aiohttp.ClientConnectorError as exc:
            return self._upstream_failed(adm, "connect", failure_reason(exc.os_error), connecting=True)
        except aiohttp.ClientError as exc:
            if _caused_by(exc, _TooLarge):  # raised in the body iterator, wrapped by the client
                return self._too_large(adm)
            if isinstance(exc.__cause__, ssl.SSLError):
                # The upstream refused the TLS session before answering (a TLS 1.3 server checks
                # the client's certificate after the client's side of the handshake): the request
                # never reached the application, like a refused connect.
                return self._upstream_failed(adm, "connect", failure_reason(exc.__cause__), connecting=True)
            reason = _client_error_reason(exc)
            return self._upstream_failed(adm, "protocol", reason)
        except asyncio.CancelledError:
            adm.finish(TurnOutcome.CLIENT_ABORTED)
            raise
        if upstream.status == 101:
            # The sidecar never asks for a protocol switch: this upstream is broken.
            upstream.close()
            reason = "the response switches protocols"
            return self._upstream_failed(adm, "protocol", reason)
        codings = _raw(upstream.headers.getall(h.TRANSFER_ENCODING, []))
        if codings and not lone_chunked(codings) and request.method != "HEAD" and upstream.status not in (204, 304):
            # aiohttp undoes only the chunked framing: another coding's bytes would reach the
            # client unlabelled.
            upstream.close()
            reason = f"invalid response: {UNSUPPORTED_CODING}"
            return self._upstream_failed(adm, "protocol", reason)
        head_size = sum(len(k) + len(v) + 4 for k, v in upstream.raw_headers)
        if head_size > dep.limits.max_header_bytes:
            upstream.close()
            reason = f"response head larger than {dep.limits.max_header_bytes} bytes"
            return self._upstream_failed(adm, "protocol", reason)
        if not self.health.settled:
            self.health.answered(dep, up)
        m.ttfb_hist(dep.name, dep.mode_name).observe(time.perf_counter() - t0)
        adm.on_response(upstream.status, upstream.headers)
        usage: UsageReader | None = None
        kept: deque[bytes] = deque(maxlen=TAIL_READS)
        seen = 0
        try:
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            _copy_response_headers(upstream, resp)
            if (
                request.version < (1, 1)
                and h.CONTENT_LENGTH not in resp.headers
                and request.method != "HEAD"
                and upstream.status not in (204, 304)
            ):
                resp.force_close()  # an unframed body to an HTTP/1.0 client ends with the connection
            if not self._keepalive:
                resp.force_close()
            closed = _close_of(upstream, request.method)
            # Only for a request chained by previous_response_id (opt-in): the body's first
            # bytes (aiohttp has taken its chunked framing off) until they named its id.
            first = (
                adm.reads_response_id
                and request.method != "HEAD"
                and adm.reads_response(upstream.status, upstream.headers)
            )
            # A session's response: its prompt-cache usage, read from the body's first reads and
            # (references to) its last few (aiohttp has taken its chunked framing off).
            usage = (
                adm.usage_reader(upstream.status, upstream.headers, False)
                if adm.turn is not None and request.method != "HEAD" and upstream.status not in (204, 304)
                else None
            )
            usage_first = usage is not None
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                if first:
                    first = not adm.response_start(chunk, False)
                if usage is not None:
                    if usage_first:
                        usage_first = not usage.first(chunk)
                    if len(chunk) >= LAST_BYTES:  # it holds the whole tail: the older reads go
                        kept.clear()
                    kept.append(chunk)
                    seen += len(chunk)
                await resp.write(chunk)
            if closed is not None and (lost := _lost(closed)) is not None:
                raise lost
            await resp.write_eof()
        except asyncio.CancelledError:
            upstream.close()
            _count_cut(adm, usage, kept, seen)
            adm.finish(TurnOutcome.CLIENT_ABORTED)
            raise
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            upstream.close()
            _count_cut(adm, usage, kept, seen)
            adm.finish(TurnOutcome.CLIENT_ABORTED)
            raise
        except (TimeoutError, aiohttp.ClientError) as exc:
            # Mid-stream upstream failure: the status line is gone, so the only honest signal left
            # is an incomplete response (aborted connection) rather than a clean end.
            upstream.close()
            timeout = isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError))
            kind = "timeout" if timeout else "reset"
            m.upstream_error(dep.name, kind).inc()
            _count_cut(adm, usage, kept, seen)
            adm.finish(TurnOutcome.UPSTREAM_FAILED)
            self.upstream_failure(
                dep,
                up,
                kind,
                f"mid-response: idle for {t.idle:g} s" if timeout else f"mid-response: {_client_error_reason(exc)}",
            )
            if request.transport is not None:
                request.transport.abort()
            raise _UpstreamCut from exc
        upstream.release()
        m.request_counter(dep.name, dep.mode_name, f"{upstream.status // 100}xx").inc()
        m.duration_hist(dep.name, dep.mode_name).observe(time.perf_counter() - t0)
        if usage is not None:  # the body went whole: what it said of its usage, before the turn ends
            usage.last_reads(kept, seen)
            adm.on_usage(usage.result())
        adm.finish(TurnOutcome.COMPLETED if upstream.status < 500 else TurnOutcome.UPSTREAM_FAILED)
        return resp

    def _upstream_failed(self, adm: Admission, kind: str, reason: str, *, connecting: bool = False) -> web.Response:
        """The upstream failed before the response began (as the fast engine's ``_upstream_failed``)."""
        decision = adm.decision
        assert decision is not None
        dep, up = decision.deployment, decision.upstream
        self.upstream_failure(dep, up, kind, reason, connecting=connecting)
        if kind == "connect":
            adm.upstream_unreachable()  # nothing was sent: fail the tree over
        self.metrics.upstream_error(dep.name, kind).inc()
        adm.finish(TurnOutcome.UPSTREAM_FAILED)
        return self._error(errors.upstream_failed(kind, dep.name, up.index, reason), dep.name, dep.mode_name)


def _count_cut(adm: Admission, usage: UsageReader | None, kept: deque[bytes], seen: int) -> None:
    """A response whose body did not end counts its usage if what was read of it reported
    counts (as the fast engine's ``Exchange._finish_admission``), else it is not counted."""
    if usage is not None:
        usage.last_reads(kept, seen)
        found = usage.result()
        if found.reported:
            adm.on_usage(found)


def _raw(values: list[str]) -> list[bytes]:
    """Header values as their bytes (aiohttp decodes them with surrogateescape)."""
    return [v.encode("utf-8", "surrogateescape") for v in values]


def _close_of(upstream: aiohttp.ClientResponse, method: str) -> asyncio.Future[None] | None:
    """For a body the upstream's close delimits (no Content-Length, not chunked), the future of
    its connection's close; else None. aiohttp ends such a body at any close, a reset too: only
    this future tells them apart (:func:`_lost`). Taken before the body is read; a reset that
    aiohttp met before this still looks like a close (aiohttp keeps no other sign of it)."""
    if method == "HEAD" or upstream.status in (204, 304) or upstream.status < 200:
        return None
    headers = upstream.headers
    codings = _raw(headers.getall(h.TRANSFER_ENCODING, []))
    if not codings and h.CONTENT_LENGTH in headers:
        return None
    if codings and lone_chunked(codings):  # (any other coding was refused before the body)
        return None
    connection = upstream.connection
    protocol = connection.protocol if connection is not None else None
    closed = protocol.closed if protocol is not None else None
    if closed is not None:
        closed.add_done_callback(_retrieve)  # (a close with an error nobody asked for is logged)
    return closed


def _retrieve(closed: asyncio.Future[None]) -> None:
    if not closed.cancelled():
        closed.exception()


def _lost(closed: asyncio.Future[None]) -> aiohttp.ClientError | None:
    """The error the connection closed with, once it closed; None for a clean close."""
    if not closed.done() or closed.cancelled():
        return None
    exc = closed.exception()
    if exc is None:
        return None
    cause = exc.__cause__
    if isinstance(cause, OSError):
        return aiohttp.ClientOSError(*cause.args)
    return exc if isinstance(exc, aiohttp.ClientError) else aiohttp.ClientConnectionError(str(exc))


def _client_error_reason(exc: BaseException) -> str:
    """A client-safe reason for an aiohttp client failure: never its repr, which carries the
    request's URL and headers."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the upstream closed the connection"
    if isinstance(exc, aiohttp.ClientResponseError):
        return "invalid response"
    if isinstance(exc, aiohttp.ClientOSError):
        # The TLS error itself (the wrapper's errno is OpenSSL's, not an OS error).
        return failure_reason(exc.__cause__ if isinstance(exc.__cause__, ssl.SSLError) else exc)
    return type(exc).__name__


def _caused_by(exc: BaseException | None, kind: type[BaseException]) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _forward_headers(decision: Decision, request: web.BaseRequest) -> CIMultiDict[str]:
    """The client's headers minus hop-by-hop and stripped ones, plus forwarding and mode headers.
    The framing fields are never copied: the caller writes them from the parsed message."""
    src = request.headers
    drop = h.HOP_BY_HOP | h.FRAMING | h.connection_tokens(src.getall(h.CONNECTION, ())) | decision.drop
    out: CIMultiDict[str] = CIMultiDict()
    xff = None
    for name, value in src.items():
        low = name.lower()
        if low in drop or low == "host" or low == "expect":
            continue
        if low == "x-forwarded-for":
            xff = value if xff is None else f"{xff}, {value}"
            continue
        out.add(name, value)
    out[h.HOST] = decision.upstream.host_header
    peer = request.remote or ""
    out[h.X_FORWARDED_FOR] = f"{xff}, {peer}" if xff else peer
    if h.X_FORWARDED_PROTO not in out:
        out[h.X_FORWARDED_PROTO] = request.scheme
    for name, value in decision.add:
        out[name] = value
    return out


def _copy_response_headers(upstream: aiohttp.ClientResponse, resp: web.StreamResponse) -> None:
    src = upstream.headers
    # A Connection header may name end-to-end fields to drop, never the framing.
    drop = h.HOP_BY_HOP | (h.connection_tokens(src.getall(h.CONNECTION, ())) - h.FRAMING)
    out = resp.headers
    for name, value in src.items():
        if name.lower() not in drop:
            out.add(name, value)


async def _read_bounded(request: web.BaseRequest, limit: int, idle: float) -> tuple[list[bytes], int]:
    """The whole request body, at most ``limit`` bytes with at most ``idle`` seconds between reads,
    as the chunks it arrived in, and its size (the router joins a large one off the loop)."""
    chunks: list[bytes] = []
    size = 0
    content = request.content
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout_at(loop.time() + idle) as deadline:
            while chunk := await content.readany():
                size += len(chunk)
                if size > limit:
                    raise _TooLarge
                chunks.append(chunk)
                deadline.reschedule(loop.time() + idle)
    except TimeoutError:
        raise _ClientTimeout from None
    return chunks or [b""], size


async def _stream_bounded(request: web.BaseRequest, limit: int) -> AsyncIterator[bytes]:
    seen = 0
    async for chunk in request.content.iter_any():
        seen += len(chunk)
        if seen > limit:
            raise _TooLarge
        yield chunk
