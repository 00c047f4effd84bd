"""The reference engine: aiohttp's low-level server and one pooled ``ClientSession``.

Slower than the protocol-level engine but built entirely on aiohttp's well-tested HTTP code;
the proxy test suite runs against both.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from sidecar import errors
from sidecar import headers as h
from sidecar.engine.base import Engine
from sidecar.lineage import TurnOutcome
from sidecar.router import BodyWork, Decision, RequestHead, body_pool

log = logging.getLogger("sidecar.engine")

# A buffered body above this size goes upstream from a stream (aiohttp's own threshold).
_LARGE_BODY = 1 << 20
_SKIP_AUTO = frozenset({"User-Agent", "Accept", "Accept-Encoding", "Content-Type"})
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _TooLarge(Exception):
    pass


class AiohttpEngine(Engine):
    """Reverse proxy on ``aiohttp.web.Server`` + ``aiohttp.ClientSession``."""

    _runner: web.ServerRunner
    _site: web.TCPSite
    _session: aiohttp.ClientSession

    async def start(self) -> None:
        limit = max(d.limits.max_connections_per_upstream for d in self.router.deployments)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=limit, enable_cleanup_closed=False),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        self._body_pool = body_pool()  # the router's BodyWork (large bodies)
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        server = web.Server(self._handle, handler_cancellation=True,
                            max_field_size=self.config.limits.max_header_bytes,
                            max_line_size=self.config.limits.max_header_bytes)
        self._runner = web.ServerRunner(server, handle_signals=False)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.config.listen.host, self.config.listen.port,
                                 backlog=1024, reuse_address=True)
        await self._site.start()

    @property
    def port(self) -> int:
        return int(self._runner.addresses[0][1])

    async def drain(self, grace: float) -> None:
        await self._site.stop()
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except asyncio.TimeoutError:
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
        return web.Response(status=exc.status, body=exc.body(), content_type="application/json")

    async def _proxy(self, request: web.BaseRequest, t0: float) -> web.StreamResponse:
        router = self.router
        in_headers = request.headers
        if h.UPGRADE in in_headers and "upgrade" in h.connection_tokens(in_headers.getall(h.CONNECTION, ())):
            exc = errors.ProxyError(errors.UPGRADE_NOT_SUPPORTED, "the sidecar does not proxy protocol upgrades")
            resp = self._error(exc, router.default.name, router.default.mode_name, "upgrade")
            resp.force_close()  # the rest of the stream belongs to the refused protocol
            return resp
        if request.method == "CONNECT" or not request.raw_path.startswith("/"):
            exc = errors.ProxyError(errors.BAD_REQUEST, "request target must be an absolute path (origin-form)")
            resp = self._error(exc, router.default.name, router.default.mode_name, "bad_request")
            resp.force_close()
            return resp
        try:
            decision = router.route(RequestHead(request.method, request.raw_path, in_headers))
        except errors.ProxyError as exc:
            return self._error(exc, router.default.name, router.default.mode_name, exc.type)
        dep = decision.deployment
        limit = decision.max_body_bytes
        declared = request.content_length
        if declared is not None and declared > limit:
            router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
            return self._error(_too_large(dep.name, limit, decision.needs_body), dep.name, dep.mode_name,
                               "body_too_large")

        body: bytes | io.BytesIO | AsyncIterator[bytes] | None = None
        if request.method not in ("GET", "HEAD") or request.body_exists:
            if in_headers.get(h.EXPECT, "").lower() == "100-continue":
                await request.writer.write(_CONTINUE)
            if decision.needs_body:
                try:
                    chunks, size = await _read_bounded(request, limit)
                    body = await self._transform(decision, chunks, size)
                except _TooLarge:
                    router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
                    return self._error(_too_large(dep.name, limit, True), dep.name, dep.mode_name, "body_too_large")
                except errors.ProxyError as exc:
                    router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
                    dep = decision.deployment
                    return self._error(exc, dep.name, dep.mode_name, exc.type)
                except asyncio.CancelledError:  # the client left
                    router.finish(decision, TurnOutcome.CLIENT_ABORTED)
                    raise
                except Exception as exc:  # a defect: still finish the turn and answer
                    log.error("request body handling failed: %r", exc, exc_info=exc, extra=decision.log_fields())
                    router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
                    dep = decision.deployment
                    internal = errors.ProxyError(errors.INTERNAL_ERROR, "the sidecar failed to handle this request")
                    return self._error(internal, dep.name, dep.mode_name)
            elif request.body_exists:
                body = _stream_bounded(request, limit)
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
        return await self._exchange(request, decision, out, body, t0)

    async def _transform(self, decision: Decision, chunks: list[bytes], size: int) -> bytes:
        """The body to forward: the router's, after its body work (a large body) ran on a
        worker thread."""
        result = self.router.transform_body(decision, chunks[0] if len(chunks) == 1 else chunks, size)
        while isinstance(result, BodyWork):
            result = result.resume(await asyncio.get_running_loop().run_in_executor(self._body_pool, result.run))
        return result

    async def _exchange(self, request: web.BaseRequest, decision: Decision, out: CIMultiDict[str],
                        body: bytes | io.BytesIO | AsyncIterator[bytes] | None, t0: float) -> web.StreamResponse:
        router = self.router
        dep = decision.deployment
        up = decision.upstream
        m = self.metrics
        t = dep.timeouts
        url = URL(up.url + request.raw_path, encoded=True)
        m.added_hist(dep.name).observe(time.perf_counter() - t0)
        resp: web.StreamResponse | None = None
        try:
            async with asyncio.timeout(t.first_byte):
                upstream = await self._session.request(
                    request.method, url, headers=out, data=body, allow_redirects=False,
                    skip_auto_headers=_SKIP_AUTO, compress=None, chunked=None,
                    timeout=aiohttp.ClientTimeout(total=None, connect=t.connect, sock_read=t.idle),
                )
        except _TooLarge:
            router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
            return self._error(_too_large(dep.name, dep.limits.max_body_bytes), dep.name, dep.mode_name,
                               "body_too_large")
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            return self._upstream_failed(decision, "timeout", errors.UPSTREAM_TIMEOUT,
                                         f"upstream of deployment {dep.name!r} ({up.url}) timed out")
        except aiohttp.ClientConnectorError as exc:
            router.upstream_unreachable(decision)
            return self._upstream_failed(decision, "connect", errors.UPSTREAM_UNREACHABLE,
                                         f"upstream of deployment {dep.name!r} ({up.url}) is unreachable: {exc.os_error}")
        except aiohttp.ClientError as exc:
            if _caused_by(exc, _TooLarge):  # raised in the body iterator, wrapped by the client
                router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
                return self._error(_too_large(dep.name, decision.max_body_bytes), dep.name, dep.mode_name,
                                   "body_too_large")
            return self._upstream_failed(decision, "protocol", errors.UPSTREAM_PROTOCOL_ERROR,
                                         f"upstream of deployment {dep.name!r} ({up.url}) failed: {exc!r}")
        except asyncio.CancelledError:
            router.finish(decision, TurnOutcome.CLIENT_ABORTED)
            raise
        self.health.mark_reached()
        m.ttfb_hist(dep.name, dep.mode_name).observe(time.perf_counter() - t0)
        router.on_response(decision, upstream.status, upstream.headers)
        try:
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            _copy_response_headers(upstream, resp)
            if (request.version < (1, 1) and h.CONTENT_LENGTH not in resp.headers and request.method != "HEAD"
                    and upstream.status not in (204, 304)):
                resp.force_close()  # an unframed body to an HTTP/1.0 client ends with the connection
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
        except asyncio.CancelledError:
            upstream.close()
            router.finish(decision, TurnOutcome.CLIENT_ABORTED)
            raise
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            upstream.close()
            router.finish(decision, TurnOutcome.CLIENT_ABORTED)
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # Mid-stream upstream failure: the status line is gone, so the only honest signal left
            # is an incomplete response (aborted connection) rather than a clean end.
            upstream.close()
            kind = "timeout" if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)) else "reset"
            m.upstream_error(dep.name, kind).inc()
            router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
            log.warning("upstream failed mid-response: %r", exc, extra=decision.log_fields())
            if request.transport is not None:
                request.transport.abort()
            raise
        upstream.release()
        m.request_counter(dep.name, dep.mode_name, f"{upstream.status // 100}xx").inc()
        m.duration_hist(dep.name, dep.mode_name).observe(time.perf_counter() - t0)
        router.finish(decision, TurnOutcome.COMPLETED if upstream.status < 500 else TurnOutcome.UPSTREAM_FAILED)
        return resp

    def _upstream_failed(self, decision: Decision, kind: str, type_: str, message: str) -> web.Response:
        dep = decision.deployment
        self.metrics.upstream_error(dep.name, kind).inc()
        self.router.finish(decision, TurnOutcome.UPSTREAM_FAILED)
        exc = errors.ProxyError(type_, message, deployment=dep.name, upstream=decision.upstream.url)
        return self._error(exc, dep.name, dep.mode_name)


def _caused_by(exc: BaseException | None, kind: type[BaseException]) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _too_large(dep: str, limit: int, parsed: bool = False) -> errors.ProxyError:
    return errors.request_too_large(dep, limit, parsed)


def _forward_headers(decision: Decision, request: web.BaseRequest) -> CIMultiDict[str]:
    """The client's headers minus hop-by-hop and stripped ones, plus forwarding and mode headers.
    The framing fields are never copied: the caller writes them from the parsed message."""
    src = request.headers
    drop = h.HOP_BY_HOP | h.FRAMING | h.connection_tokens(src.getall(h.CONNECTION, ())) | decision.strip
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


async def _read_bounded(request: web.BaseRequest, limit: int) -> tuple[list[bytes], int]:
    """The body as the chunks it arrived in, and its size (the router joins a large one off the
    loop)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    return chunks or [b""], size


async def _stream_bounded(request: web.BaseRequest, limit: int) -> AsyncIterator[bytes]:
    seen = 0
    async for chunk in request.content.iter_any():
        seen += len(chunk)
        if seen > limit:
            raise _TooLarge
        yield chunk
