"""The engine interface: request head and body in, routing decision out.

An engine owns the proxy listener and the upstream connection pool. Per request it must:

1. build a :class:`~sidecar.router.RequestHead` (its ``headers`` map every lower-case header
   name to its first value) and call ``router.route``; a raised
   :class:`~sidecar.errors.ProxyError` is answered as JSON (``exc.status``, ``exc.body()``) and
   counted in ``rejected`` with ``exc.type`` as the reason;
2. refuse a body above ``decision.max_body_bytes`` with 413 (declared length up front, streamed
   bytes as they arrive);
3. if ``decision.needs_body`` (a provisional decision: only ``max_body_bytes`` is final, and
   ``deployment`` labels errors): buffer the whole body (empty if none; ``route`` sets it only
   for requests that may carry one: a method other than GET/HEAD, or Content-Length > 0, or
   Transfer-Encoding) and call ``router.transform_body(decision, body, size)`` (``body``: the
   bytes, or the list of chunks they arrived in, which the router joins off the loop when the
   body is large; ``size``: their length). It returns the complete decision, which replaces
   the provisional one: forward its ``body`` with a fresh Content-Length (it is where the
   deployment is chosen by the body's model and the request admitted, so the upstream head of
   such a request is built only after it). It raises :class:`~sidecar.errors.ProxyError` to
   answer like in 1. For a large body it returns :class:`~sidecar.router.BodyWork` instead: run
   ``work.run`` on the engine's :func:`~sidecar.router.body_pool` and hand its result to
   ``work.resume`` on the event loop, until a decision comes back; call ``work.abandon(outcome)``
   instead when ``run`` raised (a defect: answer 500 ``internal_error``) or the client left;
4. build the upstream head: the client's headers minus hop-by-hop ones (and those named in
   ``Connection``) and ``decision.drop``, then ``decision.add`` and ``X-Forwarded-For`` /
   ``X-Forwarded-Proto``; send it to ``decision.upstream``, streaming the body when it was not
   buffered;
5. if connecting to ``decision.upstream`` fails, call ``router.upstream_unreachable(decision)``
   before answering 502 (the balancer then fails the tree over); report every upstream failure
   (connect, TLS, timeout, reset, invalid response) with :meth:`Engine.upstream_failure`;
6. when the upstream's response head arrives, call
   ``router.on_response(decision, status, headers)`` (``headers``: lower-case name lookup) before
   relaying it: it records which worker served the turn and lets the mode observe the response;
7. relay the response chunk by chunk, and call ``router.finish`` exactly once for the decision
   it holds (the provisional one while ``transform_body`` has not returned), after the last
   byte reached the client, the upstream failed, or the client left. A router call that raised
   returned no decision: what it had admitted, it released itself.
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
