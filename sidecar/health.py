"""Upstream readiness (has any upstream been reached yet?) and active upstream health checks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp

from sidecar.deployments import Deployment, Upstream

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


async def run_health_checks(deployments: Sequence[Deployment]) -> None:
    """Actively check the upstreams of every deployment with a ``health_check`` until cancelled
    (an app background task): ``GET <upstream><path>`` each interval, 2xx is a success, and
    each result goes to the deployment's balancer."""
    checked = [d for d in deployments if d.health_check is not None]
    if not checked:
        return
    async with aiohttp.ClientSession(auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()) as session:
        await asyncio.gather(*(_check_deployment(session, d) for d in checked))


async def _check_deployment(session: aiohttp.ClientSession, dep: Deployment) -> None:
    hc = dep.health_check
    assert hc is not None
    timeout = aiohttp.ClientTimeout(total=hc.timeout_seconds)
    while True:
        results = await asyncio.gather(*(_probe(session, up, hc.path, timeout) for up in dep.upstreams))
        for up, ok in zip(dep.upstreams, results, strict=True):
            dep.balancer.report(up, ok)
        await asyncio.sleep(hc.interval_seconds)


async def _probe(session: aiohttp.ClientSession, up: Upstream, path: str, timeout: aiohttp.ClientTimeout) -> bool:
    """One check; an https:// upstream is checked with its deployment's TLS settings."""
    try:
        async with session.get(up.url + path, timeout=timeout, allow_redirects=False,
                               ssl=up.tls_context or True, server_hostname=up.server_hostname) as resp:
            await resp.read()
            return 200 <= resp.status < 300
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False
