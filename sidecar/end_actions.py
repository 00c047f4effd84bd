"""Executes end-of-session actions (HTTP calls to upstreams) off the request path.

Bounded: a fixed-size queue (overflow is dropped and counted), bounded retries with backoff,
one worker task tied to the app's lifecycle. Never blocks or fails client traffic.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from urllib.parse import quote

import aiohttp
from yarl import URL

from sidecar.deployments import Deployment, Upstream
from sidecar.metrics import Metrics
from sidecar.modes.base import EndAction

log = logging.getLogger("sidecar.end_actions")


class EndActionRunner:
    """Queue + worker for :class:`EndAction` calls."""

    def __init__(
        self, metrics: Metrics, *, max_queue: int = 10_000, retries: int = 3, backoff: float = 0.2, timeout: float = 5.0
    ) -> None:
        self.metrics = metrics
        self.retries = retries
        self.backoff = backoff
        self.timeout = timeout
        self._queue: asyncio.Queue[tuple[Deployment, EndAction, Upstream, Callable[[], None] | None]] = asyncio.Queue(
            max_queue
        )
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._sending = False  # the worker is performing an action taken off the queue

    def submit(self, dep: Deployment, action: EndAction, root: str, ran: Callable[[], None] | None = None) -> None:
        """Enqueue (synchronous; called by the router). ``root`` picks the tree's upstream, now:
        the tree's failover override is dropped once it ended. ``ran`` is called once the action
        was sent (whatever the answer) or given up: after its retries, or at once when the queue
        is full (dropped)."""
        try:
            self._queue.put_nowait((dep, action, dep.pick_upstream(root), ran))
        except asyncio.QueueFull:
            self.metrics.end_actions.labels(dep.mode_name, "dropped").inc()
            if ran is not None:
                ran()

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sidecar-end-actions")

    async def stop(self, grace: float = 2.0) -> None:
        """Flush what is queued for up to ``grace`` seconds, then stop."""
        if self._task is not None:
            try:
                # (asyncio.timeout: with nothing queued the join returns at once, even for grace 0)
                async with asyncio.timeout(grace):
                    await self._queue.join()
            except TimeoutError:
                log.warning("%d end-of-session actions not sent at shutdown", self._queue.qsize() + self._sending)
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        while True:
            dep, action, up, ran = await self._queue.get()
            self._sending = True
            try:
                await self._perform(dep, action, up)
            except Exception:  # a defect must not stop the runner
                log.exception("end action %s %s failed", action.method, action.path)
            finally:
                self._sending = False
                self._queue.task_done()
            if ran is not None:  # (not when cancelled at shutdown: the action was not sent)
                ran()

    async def _perform(self, dep: Deployment, action: EndAction, up: Upstream) -> None:
        assert self._session is not None
        url = _url(up.url + action.path, action.query)
        for attempt in range(self.retries + 1):
            try:
                async with self._session.request(
                    action.method,
                    url,
                    data=action.body,
                    ssl=up.tls_context or True,
                    server_hostname=up.server_hostname,
                ) as resp:
                    await resp.read()
                    if resp.status < 500:
                        outcome = "ok" if resp.status < 400 else "rejected"
                        self.metrics.end_actions.labels(dep.mode_name, outcome).inc()
                        return
            except (TimeoutError, aiohttp.ClientError) as exc:
                log.debug("end action %s %s failed: %r", action.method, action.path, exc)
            if attempt < self.retries:
                await asyncio.sleep(self.backoff * (2**attempt))
        self.metrics.end_actions.labels(dep.mode_name, "failed").inc()


def _url(base: str, query: dict[str, str]) -> URL:
    """``base`` with ``query`` percent-encoded byte for byte: a session id holds exactly the bytes
    the client sent (headers are read as UTF-8 with surrogate escapes), so a session named by
    bytes that are not UTF-8 is finished under those bytes, never under what is left of it."""
    if not query:
        return URL(base, encoded=True)
    pairs = (
        quote(k.encode("utf-8", "surrogateescape"), safe="")
        + "="
        + quote(v.encode("utf-8", "surrogateescape"), safe="")
        for k, v in query.items()
    )
    return URL(base + "?" + "&".join(pairs), encoded=True)
