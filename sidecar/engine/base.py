"""The engine interface: request head and body in, routing decision out.

An engine owns the proxy listener and the upstream connection pool. Per request it must:
build a :class:`~sidecar.router.RequestHead`, call ``router.route`` (a raised
:class:`~sidecar.errors.ProxyError` is answered as JSON), drop hop-by-hop headers (and those named
in ``Connection``) plus ``decision.strip``, append ``decision.add`` and ``X-Forwarded-For`` /
``X-Forwarded-Proto``, stream the body (or buffer it and call ``router.transform_body`` when
``decision.needs_body``), relay the response chunk by chunk, and call ``router.finish`` exactly
once after the last byte reached the client, the upstream failed, or the client left.
"""

from __future__ import annotations

import abc

from sidecar.config import Config
from sidecar.health import UpstreamHealth
from sidecar.metrics import Metrics
from sidecar.router import Router


class Engine(abc.ABC):
    """One proxy listener."""

    def __init__(self, config: Config, router: Router, metrics: Metrics, health: UpstreamHealth) -> None:
        self.config = config
        self.router = router
        self.metrics = metrics
        self.health = health

    @abc.abstractmethod
    async def start(self) -> None:
        """Bind ``config.listen`` and start serving."""

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
