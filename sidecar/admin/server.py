"""Admin HTTP application: ``/healthz``, ``/readyz``, ``/metrics``, ``/v1/sessions``, ``/v1/trees``."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sidecar.errors import error_body
from sidecar.health import UpstreamHealth
from sidecar.metrics import Metrics
from sidecar.router import Router

ROUTER_KEY = web.AppKey("router", Router)
HEALTH_KEY = web.AppKey("health", UpstreamHealth)
METRICS_KEY = web.AppKey("metrics", Metrics)

SESSION_NOT_FOUND = "session_not_found"
TREE_NOT_FOUND = "tree_not_found"


def _json_error(status: int, type_: str, message: str) -> web.Response:
    return web.Response(status=status, body=error_body(type_, message), content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    health = request.app[HEALTH_KEY]
    if health.ready:
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "waiting_for_upstream"}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS_KEY].registry)
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


async def get_session(request: web.Request) -> web.Response:
    node = request.app[ROUTER_KEY].tree.get(request.match_info["session"])
    if node is None:
        return _json_error(404, SESSION_NOT_FOUND, "no such session")
    return web.json_response(node)


async def get_tree(request: web.Request) -> web.Response:
    tree = request.app[ROUTER_KEY].tree.tree(request.match_info["root"])
    if tree is None:
        return _json_error(404, TREE_NOT_FOUND, "no such session tree")
    return web.json_response(tree)


def build_admin_app(router: Router, health: UpstreamHealth, metrics_: Metrics) -> web.Application:
    """The admin application, sharing the proxy's router, readiness and metrics."""
    app = web.Application()
    app[ROUTER_KEY] = router
    app[HEALTH_KEY] = health
    app[METRICS_KEY] = metrics_
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/sessions/{session}", get_session)
    app.router.add_get("/v1/trees/{root}", get_tree)
    return app
