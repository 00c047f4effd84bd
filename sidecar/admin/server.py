"""Admin HTTP application: ``/healthz``, ``/readyz``, ``/metrics``, ``/openapi.json``, and the
sessions API with the lineage views under ``/v1`` (see :mod:`sidecar.admin.sessions_api`).

Health, readiness, metrics and the OpenAPI document never need a token; ``/v1/*`` does when a
tokens file is configured.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sidecar import errors
from sidecar.admin import sessions_api
from sidecar.admin.openapi import build_openapi
from sidecar.admin.sessions_api import ROUTER_KEY
from sidecar.admin.ui import add_ui_routes
from sidecar.auth import TokenSet
from sidecar.health import UpstreamHealth
from sidecar.metrics import Metrics
from sidecar.router import Router

__all__ = ["ROUTER_KEY", "build_admin_app"]

HEALTH_KEY = web.AppKey("health", UpstreamHealth)
METRICS_KEY = web.AppKey("metrics", Metrics)
OPENAPI_KEY = web.AppKey("openapi", bytes)

# Bodies of the sessions API are small JSON objects.
MAX_ADMIN_BODY = 64 * 1024


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """200 when ready, else 503; the body says why (see :meth:`UpstreamHealth.report`)."""
    ready, body = request.app[HEALTH_KEY].report()
    return web.json_response(body, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS_KEY].registry)
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI_KEY], content_type="application/json")


def build_admin_app(
    router: Router, health: UpstreamHealth, metrics_: Metrics, tokens: TokenSet | None = None
) -> web.Application:
    """The admin application, sharing the proxy's router, readiness and metrics. ``tokens``:
    the bearer tokens of the sessions API (None: open, for a loopback admin listener)."""
    app = web.Application(middlewares=[sessions_api.json_errors], client_max_size=MAX_ADMIN_BODY)
    app[HEALTH_KEY] = health
    app[METRICS_KEY] = metrics_
    app[OPENAPI_KEY] = orjson.dumps(build_openapi(router.config, authenticated=tokens is not None))
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    sessions_api.add_routes(app, router, tokens)
    add_ui_routes(
        app,
        lambda: router.tree,
        authorize=_admin_only,
        store_snapshot=_store_snapshot(router) if router.state.shared else None,
        api_getter=lambda: router.store,
        prompt_cache=router.accounting.snapshot,
    )
    return app


def _admin_only(request: web.Request) -> None:
    """The live view shows every workspace's sessions: admin tokens only (or no tokens configured)."""
    if not sessions_api.caller(request).admin:
        raise sessions_api.ApiError(errors.FORBIDDEN, "the live view needs an admin token")


def _store_snapshot(router: Router) -> Callable[[int], Awaitable[dict[str, Any]]]:
    """The live view's snapshot read from the shared session store (the whole fleet)."""
    from sidecar.admin.views import MAX_DEPTH, MAX_NODES
    from sidecar.state.redis import RedisState, StoreUnavailable
    from sidecar.state.views import ui_snapshot

    state = router.state
    assert isinstance(state, RedisState)

    async def snapshot(limit: int) -> dict[str, Any]:
        try:
            return await ui_snapshot(state, limit=limit, max_nodes=MAX_NODES, max_depth=MAX_DEPTH)
        except StoreUnavailable:
            raise sessions_api.ApiError(
                errors.STORE_UNAVAILABLE, "the shared session store is unreachable; retry", headers={"Retry-After": "1"}
            ) from None

    return snapshot
