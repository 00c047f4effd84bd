"""The sessions API on the admin listener: create, list, get, close; the lineage tree view.

Every ``/v1/*`` handler first identifies the caller (:func:`caller`): a bearer token of a
workspace sees and closes only that workspace's sessions, an admin token sees every session
(also those learned from traffic, which belong to no workspace), and without a tokens file
everything is open (allowed only on a loopback admin address, see ``admin_insecure``). A session
the caller may not see answers 404 exactly like an unknown one.

A workspace token chooses a ``session_id`` only inside its own namespace, ``<workspace>:...``
(workspace names have no ``:``); any other id is refused with 400 whether it exists or not, so
that creating a session tells a workspace nothing about another workspace's ids. Admin tokens
and the open API choose any id.

The answers come from one backend chosen when the routes are mounted (:class:`Sessions`): this
process's API table and lineage tree (:mod:`sidecar.admin.memory_sessions`), or the shared store
(:mod:`sidecar.admin.shared_sessions`). The shapes
(request body and answers) are the models of :mod:`sidecar.admin.models`, which the document
served at ``/openapi.json`` is generated from (:mod:`sidecar.admin.openapi`).
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import orjson
from aiohttp import web
from pydantic import ValidationError

from sidecar import errors
from sidecar import headers as h
from sidecar.admin.memory_sessions import MemorySessions
from sidecar.admin.models import SessionCreate
from sidecar.admin.views import VIEWS_LOCK, views_lock
from sidecar.auth import OPEN, Principal, TokenSet
from sidecar.config import format_validation_error
from sidecar.router import Router
from sidecar.sessions import SessionStatus

LIST_DEFAULT_LIMIT = 100
LIST_MAX_LIMIT = 1000


class ApiError(Exception):
    """Answered as ``{"error": {"type", "message", ...}}`` by :func:`json_errors`."""

    def __init__(self, type_: str, message: str, *, headers: dict[str, str] | None = None, **fields: Any) -> None:
        super().__init__(message)
        self.error = errors.ProxyError(type_, message, **fields)
        self.headers = headers or {}


class Auth:
    """The admin listener's view of the tokens file (None: the sessions API is open)."""

    def __init__(self, tokens: TokenSet | None) -> None:
        self.tokens = tokens


class Sessions(Protocol):
    """Where the sessions API's answers come from (:mod:`sidecar.admin.memory_sessions`,
    :mod:`sidecar.admin.shared_sessions`): resources as dicts, None for what the caller may not
    see (answered 404 exactly like an unknown id), :class:`sidecar.errors.ProxyError` for any
    other error answer."""

    async def create(
        self, who: Principal, *, session: str | None, deployment: str, ttl: float | None, parent: str | None
    ) -> dict[str, Any]: ...

    async def page(
        self, who: Principal, *, after: int, limit: int, deployment: str | None, status: SessionStatus | None
    ) -> tuple[list[dict[str, Any]], int | None]: ...

    async def get(self, who: Principal, session: str) -> dict[str, Any] | None: ...

    async def close(self, who: Principal, session: str) -> dict[str, Any] | None: ...

    async def tree(self, who: Principal, session: str) -> dict[str, Any] | None: ...


ROUTER_KEY = web.AppKey("router", Router)
AUTH_KEY = web.AppKey("auth", Auth)
SESSIONS_KEY = web.AppKey("sessions", Sessions)


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """API errors and aiohttp's own 404 / 405 become JSON errors with a stable type."""
    try:
        return await handler(request)
    except ApiError as exc:
        err = exc.error
        return web.Response(status=err.status, body=err.body(), content_type="application/json", headers=exc.headers)
    except errors.ProxyError as err:  # a backend's answer (sidecar.admin.memory_sessions, shared_sessions)
        retry = {h.RETRY_AFTER: "1"} if err.status in (429, 503) else None
        return web.Response(status=err.status, body=err.body(), content_type="application/json", headers=retry)
    except web.HTTPMethodNotAllowed as exc:
        return web.Response(
            status=405,
            content_type="application/json",
            headers={h.ALLOW: exc.headers[h.ALLOW]},
            body=errors.error_body(errors.METHOD_NOT_ALLOWED, f"{request.method} is not allowed here"),
        )
    except web.HTTPNotFound:
        return web.Response(
            status=404, content_type="application/json", body=errors.error_body(errors.NOT_FOUND, "no such resource")
        )


def caller(request: web.Request) -> Principal:
    """Who sent ``request``; raises a 401 :class:`ApiError` without a valid bearer token."""
    tokens = request.app[AUTH_KEY].tokens
    if tokens is None:
        return OPEN
    given = request.headers.get(h.AUTHORIZATION)
    principal = tokens.authenticate(given)
    if principal is None:
        challenge = 'Bearer realm="sidecar"' + (', error="invalid_token"' if given else "")
        raise ApiError(errors.UNAUTHORIZED, "a valid bearer token is required", headers={h.WWW_AUTHENTICATE: challenge})
    return principal


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json", headers=headers)


def _not_found(session: str) -> ApiError:
    return ApiError(errors.SESSION_NOT_FOUND, "no such session", session_id=session[:256])


# -- handlers --------------------------------------------------------------------------------


async def create_session(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    who = caller(request)
    try:
        raw = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise ApiError(errors.INVALID_REQUEST, "the body must be a JSON object") from None
    if not isinstance(raw, dict):
        raise ApiError(errors.INVALID_REQUEST, "the body must be a JSON object")
    try:
        body = SessionCreate.model_validate(raw)
    except ValidationError as exc:
        raise ApiError(errors.INVALID_REQUEST, format_validation_error(exc).replace("\n", "; ")) from None
    if body.session_id is not None and not who.admin:
        # Before anything looks the id up: the answer must not depend on what exists.
        prefix = f"{who.workspace}:"
        if not body.session_id.startswith(prefix) or len(body.session_id) == len(prefix):
            raise ApiError(
                errors.INVALID_REQUEST,
                f"session_id: must start with {prefix!r} followed by at least "
                "one character (a workspace token chooses ids in its own namespace)",
            )
    dep = router.deployment(body.deployment)
    if dep is None:
        raise ApiError(
            errors.UNKNOWN_DEPLOYMENT,
            f"no deployment named {body.deployment!r}",
            deployments=[d.name for d in router.deployments],
        )
    api_cfg = router.store.cfg
    ttl = body.ttl_seconds
    if ttl is not None and ttl > api_cfg.max_ttl_seconds:
        raise ApiError(errors.INVALID_REQUEST, f"ttl_seconds: must be at most {api_cfg.max_ttl_seconds:g}")
    created = await request.app[SESSIONS_KEY].create(
        who, session=body.session_id, deployment=dep.name, ttl=ttl, parent=body.parent
    )
    return _json(created, 201, headers={h.LOCATION: f"/v1/sessions/{created['id']}"})


async def list_sessions(request: web.Request) -> web.Response:
    who = caller(request)
    q = request.query
    status = q.get("status")
    if status is not None and status not in SessionStatus.__members__.values():
        raise ApiError(errors.INVALID_REQUEST, "status: must be one of active, closed, expired")
    try:
        limit = int(q.get("limit", LIST_DEFAULT_LIMIT))
    except ValueError:
        limit = 0
    if not 1 <= limit <= LIST_MAX_LIMIT:
        raise ApiError(errors.INVALID_REQUEST, f"limit: must be an integer from 1 to {LIST_MAX_LIMIT}")
    after = _decode_cursor(q.get("cursor"))
    data, nxt = await request.app[SESSIONS_KEY].page(
        who, after=after, limit=limit, deployment=q.get("deployment"), status=SessionStatus(status) if status else None
    )
    return _json({"data": data, "next_cursor": None if nxt is None else _encode_cursor(nxt)})


CURSOR_PATTERN = r"^[0-9]{1,18}$"


def _encode_cursor(seq: int) -> str:
    # Opaque to clients; it is the creation sequence number of the last session of the page.
    return str(seq)


def _decode_cursor(cursor: str | None) -> int:
    if cursor is None:
        return 0
    if re.fullmatch(CURSOR_PATTERN, cursor):
        return int(cursor)
    raise ApiError(errors.INVALID_REQUEST, "cursor: not a cursor returned by this listener")


async def get_session(request: web.Request) -> web.Response:
    sid = request.match_info["session"]
    found = await request.app[SESSIONS_KEY].get(caller(request), sid)
    if found is None:
        raise _not_found(sid)
    return _json(found)


async def close_session(request: web.Request) -> web.Response:
    sid = request.match_info["session"]
    closed = await request.app[SESSIONS_KEY].close(caller(request), sid)
    if closed is None:
        raise _not_found(sid)
    return _json(closed)


async def get_tree(request: web.Request) -> web.Response:
    """The tree a session belongs to, from its root, cut like the live view (``omitted``
    markers); node timestamps in RFC 3339. Built under the views lock, in slices (memory store:
    :mod:`sidecar.admin.views`) or in steps of the store's reads (:mod:`sidecar.state.views`)."""
    who = caller(request)
    async with request.app[VIEWS_LOCK]:  # one view at a time
        top = await request.app[SESSIONS_KEY].tree(who, request.match_info["root"])
    if top is None:
        raise ApiError(errors.TREE_NOT_FOUND, "no such session tree")
    return _json(top)


def add_routes(app: web.Application, router: Router, tokens: TokenSet | None) -> None:
    """Mount the sessions API and the tree view on ``app``."""
    app[ROUTER_KEY] = router
    app[AUTH_KEY] = Auth(tokens)
    app[SESSIONS_KEY] = _backend(router)
    views_lock(app)
    app.router.add_post("/v1/sessions", create_session)
    app.router.add_get("/v1/sessions", list_sessions)
    app.router.add_get("/v1/sessions/{session}", get_session)
    app.router.add_post("/v1/sessions/{session}/close", close_session)
    app.router.add_get("/v1/trees/{root}", get_tree)


def _backend(router: Router) -> Sessions:
    """Where the sessions API's answers come from, decided once: the shared store when sessions
    live there, else this process's table and tree."""
    if router.state.shared:
        from sidecar.admin.shared_sessions import SharedSessions  # (redis-py: only with a store)

        return SharedSessions(router)
    return MemorySessions(router)
