"""Readiness (does every deployment have an upstream that is healthy now?) and the background
checks that feed it: active HTTP health checks and a light TCP-connect probe.

An upstream's health comes from:
- its deployment's active health checks, when configured (``health_check``): the balancer's
  verdict (thresholds, and passive marks of failed connections) is the upstream's health, and
  the last check's result is the reason;
- otherwise from what was last seen of it: a background TCP connect every
  ``PROBE_INTERVAL_SECONDS`` (so a dead upstream turns readiness off without traffic), a failed
  connection while proxying (at once), a response head while proxying.

Before anything was seen an upstream is not healthy ("not checked yet"). Readiness is off
while draining (shutdown), whatever the upstreams.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from sidecar.deployments import Deployment, Upstream
from sidecar.errors import failure_reason

log = logging.getLogger("sidecar.health")

PROBE_INTERVAL_SECONDS = 2.0
# A probe's connect waits at most this long (or the deployment's connect timeout, if shorter).
PROBE_TIMEOUT_SECONDS = 2.0
# Connects in flight at once, whatever the number of upstreams.
PROBE_CONCURRENCY = 16

NOT_CHECKED = "not checked yet"


class _State:
    __slots__ = ("healthy", "reason", "since")

    def __init__(self) -> None:
        self.healthy: bool | None = None  # None: nothing seen yet
        self.reason = NOT_CHECKED
        self.since = time.time()  # wall clock of the last change of ``healthy``


class UpstreamHealth:
    """Readiness shared by the engines (passive marks), the background checks and ``/readyz``.

    ``settled`` is the one fact the request path reads: True while every upstream without active
    checks is known healthy (nothing for :meth:`answered` to change). With ``required`` false,
    readiness ignores the upstreams and nothing is tracked.
    """

    __slots__ = ("required", "draining", "settled", "deployments", "_states")

    def __init__(self, *, required: bool, deployments: Sequence[Deployment] = ()) -> None:
        self.required = required
        self.draining = False
        self.deployments = tuple(deployments)
        self._states = {(d.name, u.index): _State() for d in self.deployments for u in d.upstreams}
        self.settled = True
        self._settle()

    # -- facts from the engines (request path) ------------------------------------------------

    def answered(self, dep: Deployment, up: Upstream) -> None:
        """``up`` sent a response head: it is reachable."""
        if self.required and dep.health_check is None:
            self._set(dep, up, True, "answered a request")

    def unreachable(self, dep: Deployment, up: Upstream, reason: str) -> None:
        """Connecting to ``up`` failed while proxying (``reason``: client-safe, e.g. ``connection
        refused``). With active checks the balancer already took the mark."""
        if self.required and dep.health_check is None:
            self._set(dep, up, False, f"a request could not connect: {reason}")

    # -- readiness ------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        if self.draining:
            return False
        if not self.required:
            return True
        return all(any(self._healthy(d, u) for u in d.upstreams) for d in self.deployments)

    def report(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, body of /readyz)``: the status, why, and per deployment each upstream's
        health with its reason (upstreams by index: readiness needs no token, URLs stay out)."""
        ready = self.ready
        body: dict[str, Any] = {"status": "ready" if ready else "waiting_for_upstream"}
        if self.draining:
            body = {"status": "draining", "reason": "shutting down: new connections go to other replicas"}
        if not self.required:
            return ready, body
        deployments = []
        unserved = []
        for d in self.deployments:
            ups = []
            for u in d.upstreams:
                st = self._states[(d.name, u.index)]
                ups.append(
                    {
                        "index": u.index,
                        "healthy": self._healthy(d, u),
                        "checked_by": "health_check" if d.health_check is not None else "connect",
                        "reason": st.reason,
                        "since": _rfc3339(st.since),
                    }
                )
            served = any(x["healthy"] for x in ups)
            if not served:
                unserved.append(d.name)
            deployments.append({"name": d.name, "ready": served, "upstreams": ups})
        if unserved and not self.draining:
            body["reason"] = f"no healthy upstream for deployment{'s' if len(unserved) > 1 else ''} " + ", ".join(
                repr(n) for n in unserved
            )
        body["deployments"] = deployments
        return ready, body

    def _healthy(self, dep: Deployment, up: Upstream) -> bool:
        st = self._states[(dep.name, up.index)]
        if st.healthy is None:
            return False
        if dep.health_check is not None:
            return bool(dep.balancer.is_healthy(up))
        return st.healthy

    def _set(self, dep: Deployment, up: Upstream, healthy: bool, reason: str, *, log_change: bool = True) -> None:
        st = self._states[(dep.name, up.index)]
        st.reason = reason
        if st.healthy is healthy:
            return
        before = st.healthy
        st.healthy = healthy
        st.since = time.time()
        self._settle()
        if not log_change:
            return
        fields = {"deployment": dep.name, "upstream": up.display, "upstream_index": up.index, "reason": reason}
        if not healthy:
            log.warning("upstream unreachable: %s", reason, extra=fields)
        elif before is not None:
            log.info("upstream reachable again", extra=fields)
        else:
            log.info("upstream reachable", extra=fields)

    def _settle(self) -> None:
        self.settled = not self.required or all(
            self._states[(d.name, u.index)].healthy
            for d in self.deployments
            if d.health_check is None
            for u in d.upstreams
        )

    # -- background checks ------------------------------------------------------------------------

    async def probe(self, *, interval: float | None = None) -> None:
        """TCP-connect to every upstream without active health checks, every ``interval``
        seconds (default ``PROBE_INTERVAL_SECONDS``), until cancelled (an app background task).
        One connect per address per round, at most ``PROBE_CONCURRENCY`` at once; the
        connection is closed as soon as it is established."""
        targets: dict[tuple[str, int], list[tuple[Deployment, Upstream]]] = {}
        timeouts: dict[tuple[str, int], float] = {}
        for d in self.deployments:
            if d.health_check is not None:
                continue
            for u in d.upstreams:
                addr = (u.host, u.port)
                targets.setdefault(addr, []).append((d, u))
                timeouts[addr] = min(timeouts.get(addr, PROBE_TIMEOUT_SECONDS), d.timeouts.connect)
        if not self.required or not targets:
            return
        gate = asyncio.Semaphore(PROBE_CONCURRENCY)
        while True:
            await asyncio.gather(
                *(self._probe(addr, members, timeouts[addr], gate) for addr, members in targets.items())
            )
            await asyncio.sleep(PROBE_INTERVAL_SECONDS if interval is None else interval)

    async def _probe(
        self, addr: tuple[str, int], members: list[tuple[Deployment, Upstream]], timeout: float, gate: asyncio.Semaphore
    ) -> None:
        async with gate:
            try:
                async with asyncio.timeout(timeout):
                    transport, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, *addr)
            except Exception as exc:  # whatever stops a connect (refused, timeout, DNS) fails the probe
                for d, u in members:
                    self._set(d, u, False, f"connect failed: {failure_reason(exc)}")
                return
        transport.close()
        for d, u in members:
            self._set(d, u, True, "connect succeeded")

    def checked(self, dep: Deployment, up: Upstream, reason: str) -> None:
        """An active health check of ``up`` finished (its result already went to the balancer)."""
        self._set(dep, up, bool(dep.balancer.is_healthy(up)), reason, log_change=False)


def _rfc3339(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


async def run_health_checks(deployments: Sequence[Deployment], health: UpstreamHealth | None = None) -> None:
    """Actively check the upstreams of every deployment with a ``health_check`` until cancelled
    (an app background task): ``GET <upstream><path>`` each interval, 2xx is a success; each
    result goes to the deployment's balancer, and its reason to ``health`` (readiness)."""
    checked = [d for d in deployments if d.health_check is not None]
    if not checked:
        return
    async with aiohttp.ClientSession(auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()) as session:
        await asyncio.gather(*(_check_deployment(session, d, health) for d in checked))


async def _check_deployment(session: aiohttp.ClientSession, dep: Deployment, health: UpstreamHealth | None) -> None:
    hc = dep.health_check
    assert hc is not None
    timeout = aiohttp.ClientTimeout(total=hc.timeout_seconds)
    while True:
        results = await asyncio.gather(*(_check(session, up, hc.path, timeout) for up in dep.upstreams))
        for up, (ok, reason) in zip(dep.upstreams, results, strict=True):
            dep.balancer.report(up, ok)
            if health is not None:
                health.checked(dep, up, f"GET {hc.path}: {reason}")
        await asyncio.sleep(hc.interval_seconds)


async def _check(
    session: aiohttp.ClientSession, up: Upstream, path: str, timeout: aiohttp.ClientTimeout
) -> tuple[bool, str]:
    """``(healthy, reason)`` of one active check; an https:// upstream is checked with its
    deployment's TLS settings."""
    try:
        async with session.get(
            up.url + path,
            timeout=timeout,
            allow_redirects=False,
            ssl=up.tls_context or True,
            server_hostname=up.server_hostname,
        ) as resp:
            await resp.read()
            return 200 <= resp.status < 300, f"answered {resp.status}"
    except TimeoutError:
        return False, "timed out"
    except aiohttp.ClientConnectorError as exc:
        return False, failure_reason(exc.os_error)
    except (aiohttp.ClientError, OSError) as exc:
        return False, failure_reason(exc)
