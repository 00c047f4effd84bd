"""The protocol-level engine: asyncio Protocols, llhttp parsing, raw byte forwarding.

One request, from bytes in to bytes out, through the modules of this engine:

- :mod:`sidecar.engine.fast_connection`: a client connection's bytes go to the request parser
  (:mod:`sidecar.engine.parsers`, llhttp strict); each head becomes an exchange, queued and
  answered in order; the connection's watchdog times them;
- :mod:`sidecar.engine.fast_exchange`: the exchange asks the router for a decision, builds the
  upstream request head from the raw header block (:mod:`sidecar.engine.head`), sends it and
  streams the body, turns the response head into the client's, and ends exactly once;
- :mod:`sidecar.engine.fast_upstream`: pooled keep-alive upstream connections; each parses a
  response head with llhttp and hands the body's reads to
- :mod:`sidecar.engine.relay`: the body's bytes pass to the client unchanged as they arrive,
  their framing tracked without a Python call per chunk;
- :mod:`sidecar.engine.flow` (backpressure: a write buffer above its high-water mark on one side
  pauses reading on the other), :mod:`sidecar.engine.wire` (constants and the JSON error
  answers), :mod:`sidecar.engine.phases` (an exchange's phases),
  :mod:`sidecar.engine.idle_poll` (opt-in polling instead of sleeping under load).

This module is the engine itself: the listener, the pools (one per upstream address and TLS
context), the state every connection shares (:class:`~sidecar.engine.fast_exchange.EngineState`),
drain and close, and diagnostics. Per request there is no task, no future and no timer.

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
from typing import Any

from sidecar import headers as h
from sidecar.compiled import is_compiled
from sidecar.engine.base import Engine
from sidecar.engine.direct import DirectReads
from sidecar.engine.fast_connection import ClientConnection
from sidecar.engine.fast_exchange import EngineState
from sidecar.engine.fast_upstream import UpstreamPool
from sidecar.engine.idle_poll import IdlePoller, cpu_quota
from sidecar.router import body_pool

log = logging.getLogger("sidecar.engine")


def _stream_thread(loop: asyncio.AbstractEventLoop) -> Any:
    """The engine's DirectReads, or None where its thread cannot start (a thread or descriptor
    limit): streamed bodies then go through the event loop, as in the pure-Python build."""
    try:
        return DirectReads(loop)
    except (OSError, MemoryError) as exc:
        log.warning("stream thread not started, streamed bodies go through the event loop: %s", exc)
        return None


class FastEngine(Engine):
    """Reverse proxy on asyncio Protocols (uvloop in production) with llhttp parsing."""

    compiled = is_compiled(sys.modules[__name__])

    _server: asyncio.AbstractServer
    _port: int
    loop: asyncio.AbstractEventLoop

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.clients: set[ClientConnection] = set()
        self.shared = EngineState(self, self.router, self.metrics.in_flight.labels(), self.health)
        self._pools: list[UpstreamPool] = []
        self.direct: Any = None  # sidecar.engine.direct.DirectReads, once started (compiled build)
        self.body_pool = body_pool()  # an admission's body work (large bodies)

    async def start(self) -> None:
        self.loop = loop = asyncio.get_running_loop()
        poll_us = self.config.idle_poll_us
        if poll_us:
            quota = cpu_quota()
            if quota is not None and quota < 1:
                log.warning(
                    "idle polling is on (idle_poll_us %d) under a CPU quota of %.2g CPU: polling spends "
                    "the quota, and the container is then throttled until the next period, which costs "
                    "more latency than polling saves (idle_poll_us: 0 turns it off)",
                    poll_us,
                    quota,
                )
        self.shared.poller = poller = IdlePoller(loop, poll_us / 1e6)
        # Long response bodies from plain-TCP upstreams are relayed by its thread (compiled build only).
        self.direct = direct = None if DirectReads is None else _stream_thread(loop)
        self.metrics.watch_poller(poller)
        if direct is not None:
            self.metrics.watch_stream_reads(direct)
        shared = self.shared
        # One pool per upstream address and TLS context (one per deployment: deployments with
        # other TLS settings never share a connection), bounded by the largest limits of the
        # deployments using it.
        limits: dict[tuple[Any, ...], tuple[int, int]] = {}
        for dep in self.router.deployments:
            for up in dep.upstreams:
                key = (up.host, up.port, up.tls_context)
                conns, head = limits.get(key, (0, 0))
                limits[key] = (
                    max(conns, dep.limits.max_connections_per_upstream),
                    max(head, dep.limits.max_header_bytes),
                )
        pools: dict[tuple[Any, ...], UpstreamPool] = {}
        for dep in self.router.deployments:
            for up in dep.upstreams:
                key = (up.host, up.port, up.tls_context)
                if key not in pools:
                    pools[key] = UpstreamPool(
                        loop, up.host, up.port, *limits[key], poller, up.tls_context, up.server_hostname, direct
                    )
                shared.upstreams[up.pool_key] = (
                    pools[key],
                    b" " + up.base_path.encode(),
                    f" HTTP/1.1\r\n{h.HOST}: {up.host_header}\r\n".encode(),
                )
        self._pools = list(pools.values())
        listen = self.config.listen
        clients, max_head = self.clients, self.config.limits.max_header_bytes
        head_timeout = self.config.head_timeout_seconds
        self._server = await loop.create_server(
            # (a protocol by its methods: compiled, it cannot subclass asyncio.Protocol)
            lambda: ClientConnection(shared, loop, clients, max_head, head_timeout),  # type: ignore[arg-type,return-value]
            listen.host,
            listen.port,
            backlog=1024,
            reuse_address=True,
        )
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
            except TimeoutError:
                log.warning("drain grace expired with %d requests in flight", shared.in_flight)

    async def close(self) -> None:
        if self.shared.poller is not None:
            self.shared.poller.stop()
        self._server.close()
        for client in list(self.clients):
            client.abort_all()
        for pool in self._pools:
            pool.close()
        if self.direct is not None:
            self.direct.close()
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
