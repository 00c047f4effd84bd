"""Wires config, router, engine, admin listener and background tasks; owns the lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time

from aiohttp import web
from prometheus_client import CollectorRegistry

from sidecar import __version__
from sidecar.admin.server import build_admin_app
from sidecar.auth import TokenSet, load_tokens
from sidecar.config import Config, redact_url
from sidecar.end_actions import EndActionRunner
from sidecar.engine.aiohttp_engine import AiohttpEngine
from sidecar.engine.base import Engine
from sidecar.engine.fast import FastEngine
from sidecar.health import UpstreamHealth, run_health_checks
from sidecar.metrics import GcPauses, Metrics
from sidecar.sessions import Clock
from sidecar.state import SessionState
from sidecar.wiring import routing_core

log = logging.getLogger("sidecar")

EXPIRY_INTERVAL = 1.0
# The engines, by their config ``engine`` value.
ENGINES: dict[str, type[Engine]] = {"fast": FastEngine, "aiohttp": AiohttpEngine}


class Sidecar:
    """One running sidecar: proxy listener, admin listener, expiry and end-of-session workers.

    ``await start()`` binds both listeners (``proxy_url`` / ``admin_url`` then hold the real
    ports); ``await stop()`` drains in-flight requests for ``drain_grace_seconds``, ends every
    live session (reason ``shutdown``), and releases everything. ``await shutdown(delay)`` is
    what a signal starts: not ready at once, serving for ``delay`` more seconds, then ``stop()``.
    """

    def __init__(
        self, config: Config, *, registry: CollectorRegistry | None = None, session_clock: Clock | None = None
    ) -> None:
        self.config = config
        self.metrics = Metrics(registry)
        self.end_actions = EndActionRunner(self.metrics)
        # ``session_clock``: wall-clock seconds of the API session store (tests inject one).
        self.router = routing_core(
            config, self.metrics, send=self.end_actions.submit, session_clock=session_clock or time.time
        )
        # Where sessions live beyond this process; the tree and the API table are its cache here.
        self.state: SessionState = self.router.state
        self.tokens: TokenSet | None = load_tokens(config.admin_tokens_file) if config.admin_tokens_file else None
        self.health = UpstreamHealth(required=config.readiness_check_upstream, deployments=self.router.deployments)
        self.engine = ENGINES[config.engine](config, self.router, self.metrics, self.health)
        self.metrics.set_build_info(__version__, config.engine, self.engine.compiled)
        self._gc_pauses = GcPauses(self.metrics)
        self._admin_runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.proxy_url = ""
        self.admin_url = ""
        self._stopped = False

    async def start(self) -> None:
        cfg = self.config
        await self.state.start()  # refuses to start when a required store is unreachable
        await self.end_actions.start()
        engine_started = False
        try:
            await self.engine.start()
            engine_started = True
            admin = build_admin_app(self.router, self.health, self.metrics, self.tokens)
            # An admin connection that has not sent a whole request head within the head timeout
            # of opening, or of its last answer, is closed (aiohttp's keep-alive timer, armed
            # from the connection's start since aiohttp 3.14.5): slow or silent connections do
            # not pile up on the admin port, which probes and scrapers must reach.
            self._admin_runner = web.AppRunner(
                admin, handle_signals=False, access_log=None, keepalive_timeout=cfg.head_timeout_seconds
            )
            await self._admin_runner.setup()
            site = web.TCPSite(self._admin_runner, cfg.admin.host, cfg.admin.port, reuse_address=True)
            await site.start()
        except BaseException:
            if engine_started:
                await self.engine.close()
            if self._admin_runner is not None:
                await self._admin_runner.cleanup()
            await self.end_actions.stop(0)
            await self.state.stop()
            raise
        admin_port = self._admin_runner.addresses[0][1]
        self.proxy_url = f"http://{_url_host(cfg.listen.host)}:{self.engine.port}"
        self.admin_url = f"http://{_url_host(cfg.admin.host)}:{admin_port}"
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._expiry_loop(), name="sidecar-expiry"))
        if any(d.health_check is not None for d in self.router.deployments):
            self._tasks.append(
                loop.create_task(run_health_checks(self.router.deployments, self.health), name="sidecar-health-checks")
            )
        if self.health.required:
            self._tasks.append(loop.create_task(self.health.probe(), name="sidecar-upstream-probe"))
        self._gc_pauses.start()
        log.info(
            "sidecar started",
            extra={
                "version": __version__,
                "engine": cfg.engine,
                "compiled": self.engine.compiled,
                "listen": _address(cfg.listen.host, self.engine.port),
                "admin": _address(cfg.admin.host, admin_port),
                "state": redact_url(cfg.state.url),
                "deployments": [
                    {"name": d.name, "mode": d.mode_name, "upstreams": [u.display for u in d.upstreams]}
                    for d in self.router.deployments
                ],
            },
        )
        for d in self.router.deployments:
            notice = d.mode.notice() if d.mode is not None else None
            if notice:
                log.warning(notice, extra={"deployment": d.name, "mode": d.mode_name})

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_INTERVAL)
            while self.router.expire():  # a backlog is ended in batches, the proxy served between
                await asyncio.sleep(0)

    async def shutdown(self, delay: float, hurry: asyncio.Event | None = None) -> None:
        """Leave the load balancers' endpoints, then stop: ``/readyz`` answers 503 at once while
        the proxy keeps accepting and serving for ``delay`` seconds (or until ``hurry`` is set),
        each answer closing its connection so that clients reconnect to a ready replica; then
        :meth:`stop`."""
        if self._stopped:
            return
        self.health.draining = True
        self.engine.stop_keepalive()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for((hurry or asyncio.Event()).wait(), delay)
        await self.stop()

    async def stop(self) -> None:
        """Graceful: refuse new connections, drain, end sessions, close."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.health.draining = True
            log.info("draining", extra={"grace_seconds": self.config.drain_grace_seconds})
            await self.engine.drain(self.config.drain_grace_seconds)
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.engine.close()
            self.engine.failures.close()
            self.router.shutdown()  # with a shared store: only forgets (the sessions live on in the store)
            # The end actions first: the store's last write confirms the ends they ran, and a
            # claim this replica did not get to run goes to the fleet once its lease is gone.
            await self.end_actions.stop()
            await self.state.stop()
            if self._admin_runner is not None:
                await self._admin_runner.cleanup()
        finally:
            self._gc_pauses.stop()
        log.info("sidecar stopped")


def _address(host: str, port: int) -> str:
    """A bound address as ``HOST:PORT`` (``[v6]:PORT``), as configured: ``0.0.0.0`` stays."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


async def serve(config: Config) -> None:
    """Run until SIGTERM / SIGINT, then shut down gracefully (:meth:`Sidecar.shutdown`); a
    second signal during the shutdown delay ends the delay at once."""
    sidecar = Sidecar(config)
    stop = asyncio.Event()
    hurry = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set() and not hurry.is_set():
            log.info("second signal received: ending the shutdown delay")
            hurry.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await sidecar.start()
    # Everything allocated so far (imported modules, config, app objects) lives as long as the
    # process: move it out of the collector's reach so full collections, whose cost grows with
    # the session tree, do not also walk it on every pass.
    gc.freeze()
    try:
        await stop.wait()
        log.info(
            "signal received: not ready; serving on until the shutdown delay ends, then draining",
            extra={"delay_seconds": config.shutdown_delay_seconds, "grace_seconds": config.drain_grace_seconds},
        )
        await sidecar.shutdown(config.shutdown_delay_seconds, hurry)
    finally:
        await sidecar.stop()
