"""The engine interface: request head and body in, routing decision out.

An engine owns the proxy listener and the upstream connection pool. Per request it:

1. builds a :class:`~sidecar.router.RequestHead` (``headers``: every lower-case header name to
   its first value; ``target``: the request target's bytes), calls ``router.admit`` and does what the :class:`~sidecar.router.Admission`
   needs until it is READY or REFUSED: LOAD, await ``router.state.load(adm.identity)`` and call
   ``adm.loaded()``; BODY, buffer the whole body and call ``adm.body(data, size)``; WORK, run
   ``adm.work`` on the engine's :func:`~sidecar.router.body_pool` and call ``adm.worked(result)``.
   REFUSED: answer ``adm.error`` as JSON, counted in ``rejected`` for ``adm.reason``;
2. refuses a body above ``adm.limit`` with ``adm.too_large()`` (413; declared length up front,
   streamed bytes as they arrive);
3. forwards what ``adm.decision`` says: to ``decision.upstream``, the client's headers minus
   hop-by-hop ones (and those ``Connection`` names) and ``decision.drop``, then ``decision.add``,
   ``X-Forwarded-For`` and ``X-Forwarded-Proto``; ``decision.body`` with a fresh Content-Length
   when the router read the body, else the client's body as it streams;
4. reports the upstream: ``adm.upstream_unreachable()`` when connecting failed (before answering
   502: the tree fails over) and :meth:`Engine.upstream_failure` for every failure;
   ``adm.on_response(status, headers)`` when the response head arrives, before relaying it; the
   body's first reads to ``adm.response_start`` when ``adm.reads_response`` asked for them;
   for a response with a body of a request with a session (``adm.turn``), the reader
   ``adm.usage_reader(status, headers, chunked)`` gives (if any): the body's first reads to its
   ``first`` until it returns True, bounded copies of the body's last bytes to its ``last``
   (the bytes as they came from the upstream, framing included when ``chunked``), and, once the
   body reached the client whole (never after a client left or an upstream failure), its
   ``result()`` to ``adm.on_usage`` before ``finish``. The relayed bytes are never changed;
5. calls ``adm.finish(outcome)`` once the request is over (its last byte reached the client, the
   upstream failed, the client left), whatever the admission was waiting for: the admission
   counts the first call only and ignores any feed after it.
"""

from __future__ import annotations

import abc

from sidecar.config import Config
from sidecar.deployments import Deployment, Upstream
from sidecar.health import UpstreamHealth
from sidecar.metrics import Metrics
from sidecar.router import Router
from sidecar.upstream_failures import UpstreamFailureLog


class Engine(abc.ABC):
    """One proxy listener."""

    # Whether the per-request path runs as compiled extension modules (see setup.py).
    compiled = False

    def __init__(self, config: Config, router: Router, metrics: Metrics, health: UpstreamHealth) -> None:
        self.config = config
        self.router = router
        self.metrics = metrics
        self.health = health
        self.failures = UpstreamFailureLog()

    def upstream_failure(
        self, dep: Deployment, up: Upstream, kind: str, reason: str, *, connecting: bool = False
    ) -> None:
        """A request failed on the upstream side: log it (rate-limited); ``connecting``: no
        connection could be made, which also counts against the upstream's readiness.
        ``kind``: the ``sidecar_upstream_errors_total`` kind; ``reason``: client-safe, stable."""
        self.failures.record(dep.name, up, kind, reason)
        if connecting:
            self.health.unreachable(dep, up, reason)

    @abc.abstractmethod
    async def start(self) -> None:
        """Bind ``config.listen`` and start serving."""

    @abc.abstractmethod
    def stop_keepalive(self) -> None:
        """Shutdown has begun (readiness is off) but connections are still accepted: answer
        every request as usual, each response closing its connection, so that clients
        reconnect and their load balancer picks a ready replica."""

    @property
    @abc.abstractmethod
    def port(self) -> int:
        """The bound port (useful when ``listen`` asked for port 0)."""

    @abc.abstractmethod
    async def drain(self, grace: float) -> None:
        """Stop accepting connections, let in-flight requests finish for up to ``grace`` seconds."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Abort whatever is left and release the upstream pool."""
