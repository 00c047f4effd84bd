"""Upstream readiness: has any upstream been reached yet?"""

from __future__ import annotations

import asyncio
import logging

from sidecar.deployments import Upstream

log = logging.getLogger("sidecar.health")


class UpstreamHealth:
    """Readiness fact shared by the engines (which mark successes) and the admin listener."""

    __slots__ = ("reached", "required", "draining")

    def __init__(self, *, required: bool) -> None:
        self.required = required
        self.reached = False
        self.draining = False

    @property
    def ready(self) -> bool:
        return not self.draining and (self.reached or not self.required)

    def mark_reached(self) -> None:
        self.reached = True

    async def probe_until_reached(self, upstreams: list[Upstream], *, interval: float = 1.0,
                                  timeout: float = 2.0) -> None:
        """TCP-connect to each upstream until one answers (runs as an app background task)."""
        while not self.reached:
            for up in upstreams:
                try:
                    _, writer = await asyncio.wait_for(asyncio.open_connection(up.host, up.port), timeout)
                except (OSError, asyncio.TimeoutError):
                    continue
                writer.close()
                self.mark_reached()
                log.info("upstream reachable", extra={"upstream": up.url})
                return
            await asyncio.sleep(interval)
