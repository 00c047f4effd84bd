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

Handlers call the router synchronously (no await between a check and its effect), so a close
is ordered with every request admission on the event loop. The tree view is the exception: it
is built in slices that let the proxy run in between (:mod:`sidecar.admin.views`). The shapes
(request body and answers) are the models of :mod:`sidecar.admin.models`, which the document
served at ``/openapi.json`` is generated from (:mod:`sidecar.admin.openapi`).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Generator, Iterator
from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from sidecar import errors
from sidecar import headers as h
from sidecar.admin.api_views import API_END_REASONS, api_root, overlay_steps, view_steps
from sidecar.admin.models import SessionCreate
from sidecar.admin.views import MAX_DEPTH, MAX_NODES, VIEWS_LOCK, run_sliced, views_lock
from sidecar.auth import OPEN, Principal, TokenSet
from sidecar.config import format_validation_error
from sidecar.lineage import VIEW_STEP, TreeView
from sidecar.router import Router
from sidecar.sessions import ApiSession, SessionExists, SessionLimitReached, SessionStatus, rfc3339

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


ROUTER_KEY = web.AppKey("router", Router)
AUTH_KEY = web.AppKey("auth", Auth)


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """API errors and aiohttp's own 404 / 405 become JSON errors with a stable type."""
    try:
        return await handler(request)
    except ApiError as exc:
        err = exc.error
        return web.Response(status=err.status, body=err.body(), content_type="application/json", headers=exc.headers)
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


# -- resources -------------------------------------------------------------------------------


def _wall_offset(router: Router) -> float:
    """What to add to a lineage tree clock value to get wall-clock seconds."""
    return time.time() - router.tree.now()


_LINEAGE_DEFAULTS: dict[str, Any] = {
    "turns": 0,
    "in_flight": 0,
    "final_turn_seen": False,
    "placeholder": False,
    "end_reason": None,
    "workers": [],
    "affinity": {"first": 0, "same_worker": 0, "moved": 0},
}


def api_resource(router: Router, rec: ApiSession) -> dict[str, Any]:
    """An API session, with the lineage facts of its live node when the tree holds one. The
    fields of a traffic session's (:func:`traffic_resource`): never a placeholder; its end reason
    is the tree's when a request made the tree end it, else the API's (closed, expired)."""
    out = rec.as_dict()
    out["origin"] = "api"
    out.update(_LINEAGE_DEFAULTS)
    out["root"] = api_root(router.tree, router.store, rec)
    out["in_flight"] = rec.in_flight
    out["end_reason"] = API_END_REASONS.get(rec.status)
    node = router.tree.get(rec.id)
    if node is not None and node["deployment"] == rec.deployment and not node["placeholder"]:
        out["root"] = node["root"]
        out["turns"] = node["turns"]
        out["final_turn_seen"] = node["final_turn_seen"]
        out["workers"] = node["workers"]
        out["affinity"] = node["affinity"]
        out["end_reason"] = node["end_reason"]  # (null while it drains after a close)
        if rec.parent is None:
            out["parent"] = node["parent"]
    return out


def traffic_resource(router: Router, node: dict[str, Any]) -> dict[str, Any]:
    """A session learned from traffic (a lineage node): no workspace, idle expiry of the tree."""
    closed = node["closed"] or node["ended"]
    offset = _wall_offset(router)
    last = offset + node["last_active_at"]
    idle = router.config.sessions.idle_ttl_seconds
    return {
        "id": node["session"],
        "deployment": node["deployment"],
        "workspace": None,
        "status": SessionStatus.CLOSED.value if closed else SessionStatus.ACTIVE.value,
        "origin": "traffic",
        "parent": node["parent"],
        "ttl_seconds": idle,
        "created_at": rfc3339(offset + node["created_at"]),
        "last_active_at": rfc3339(last),
        "expires_at": None if closed else rfc3339(last + idle),
        "ended_at": None,
        "root": node["root"],
        "turns": node["turns"],
        "in_flight": node["in_flight"],
        "final_turn_seen": node["final_turn_seen"],
        "placeholder": node["placeholder"],
        "end_reason": node["end_reason"],
        "workers": node["workers"],
        "affinity": node["affinity"],
    }


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json", headers=headers)


def _not_found(session: str) -> ApiError:
    return ApiError(errors.SESSION_NOT_FOUND, "no such session", session_id=session[:256])


@contextlib.contextmanager
def _store_errors() -> Iterator[None]:
    """Answers of the shared store's paths (sidecar.admin.shared_sessions) as API errors."""
    from sidecar.admin.shared_sessions import StoreError

    try:
        yield
    except StoreError as exc:
        err = exc.error
        raise ApiError(
            err.type, err.message, headers={h.RETRY_AFTER: "1"} if err.status in (429, 503) else None, **err.fields
        ) from None


def _visible(router: Router, who: Principal, session: str) -> ApiSession | None:
    rec = router.store.get(session)
    return rec if rec is not None and who.sees(rec.workspace) else None


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
    if router.state.shared:
        from sidecar.admin import shared_sessions as shared

        with _store_errors():
            created = await shared.create(
                router, who, session=body.session_id, deployment=dep.name, ttl=ttl, parent=body.parent
            )
        return _json(created, 201, headers={h.LOCATION: f"/v1/sessions/{created['id']}"})
    root = None
    if body.parent is not None:
        parent = _visible(router, who, body.parent)
        if parent is None or parent.status is not SessionStatus.ACTIVE or parent.deployment != dep.name:
            raise ApiError(
                errors.PARENT_NOT_FOUND, f"parent: no active session of deployment {dep.name!r} that you created"
            )
        root = api_root(router.tree, router.store, parent)  # the session joins its parent's tree
    if body.session_id is not None and router.tree.bound_deployment(body.session_id) is not None:
        raise ApiError(errors.SESSION_EXISTS, "a live session with this id exists (learned from traffic)")
    try:
        rec = router.store.create(
            deployment=dep.name,
            workspace=who.workspace,
            session_id=body.session_id,
            ttl=ttl,
            parent=body.parent,
            root=root,
        )
    except SessionExists:
        raise ApiError(errors.SESSION_EXISTS, "a session with this id exists or was closed recently") from None
    except SessionLimitReached as exc:
        raise ApiError(
            errors.SESSION_LIMIT_REACHED,
            f"{exc.args[0]} active sessions exist already; close some",
            headers={h.RETRY_AFTER: "1"},
        ) from None
    return _json(api_resource(router, rec), 201, headers={h.LOCATION: f"/v1/sessions/{rec.id}"})


async def list_sessions(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
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
    if router.state.shared:
        from sidecar.admin import shared_sessions as shared

        with _store_errors():
            data, nxt = await shared.page(
                router,
                who,
                after=after,
                limit=limit,
                deployment=q.get("deployment"),
                status=SessionStatus(status) if status else None,
            )
        return _json({"data": data, "next_cursor": None if nxt is None else _encode_cursor(nxt)})
    page, nxt = router.store.page(
        workspace=who.workspace,
        all_workspaces=who.admin,
        deployment=q.get("deployment"),
        status=SessionStatus(status) if status else None,
        after=after,
        limit=limit,
    )
    return _json(
        {"data": [api_resource(router, r) for r in page], "next_cursor": None if nxt is None else _encode_cursor(nxt)}
    )


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
    router = request.app[ROUTER_KEY]
    who = caller(request)
    sid = request.match_info["session"]
    if router.state.shared:
        from sidecar.admin import shared_sessions as shared

        with _store_errors():
            found = await shared.get(router, who, sid)
        if found is None:
            raise _not_found(sid)
        return _json(found)
    rec = _visible(router, who, sid)
    if rec is not None:
        return _json(api_resource(router, rec))
    node = _traffic_node(router, who, sid)
    if node is not None:
        return _json(traffic_resource(router, node))
    raise _not_found(sid)


async def close_session(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    who = caller(request)
    sid = request.match_info["session"]
    if router.state.shared:
        from sidecar.admin import shared_sessions as shared

        with _store_errors():
            closed = await shared.close(router, who, sid)
        if closed is None:
            raise _not_found(sid)
        return _json(closed)
    if _visible(router, who, sid) is not None:
        rec = router.close_api_session(sid)
        assert rec is not None
        return _json(api_resource(router, rec))
    node = _traffic_node(router, who, sid)
    if node is not None and not node["placeholder"]:
        router.close_session(sid)
        node = router.tree.get(sid) or {**node, "closed": True}
        return _json(traffic_resource(router, node))
    raise _not_found(sid)


def _traffic_node(router: Router, who: Principal, sid: str) -> dict[str, Any] | None:
    """The lineage node of a session learned from traffic (not an API session); admins only."""
    if router.store.get(sid) is not None or not who.admin:
        return None
    return router.tree.get(sid)


async def get_tree(request: web.Request) -> web.Response:
    """The tree a session belongs to, from its root, cut like the live view (``omitted``
    markers); node timestamps in RFC 3339. Built under the views lock, in slices (memory store:
    :mod:`sidecar.admin.views`) or in steps of the store's reads (:mod:`sidecar.state.views`)."""
    router = request.app[ROUTER_KEY]
    who = caller(request)
    if router.state.shared:
        from sidecar.admin import shared_sessions as shared

        with _store_errors():
            async with request.app[VIEWS_LOCK]:  # one view at a time, as with the memory store
                top = await shared.tree(
                    router, who, request.match_info["root"], max_depth=MAX_DEPTH, max_nodes=MAX_NODES
                )
        if top is None:
            raise ApiError(errors.TREE_NOT_FOUND, "no such session tree")
        return _json(top)
    async with request.app[VIEWS_LOCK]:
        view, _ = await run_sliced(_stamped(router, _tree_steps(router, who, request.match_info["root"])))
    if view is None:
        raise ApiError(errors.TREE_NOT_FOUND, "no such session tree")
    return _json(view.tree)


def _tree_steps(router: Router, who: Principal, session: str) -> Generator[None, None, TreeView | None]:
    """The view of the tree ``session`` is shown in (its API sessions included), if ``who``
    sees it."""
    overlay = yield from overlay_steps(router.tree, router.store)
    root = overlay.root_of(router.tree, session)
    # Only the workspace owning the tree's root session sees it. No pause between this check and
    # the builder's first step, which fixes the root it walks down from.
    if root is None or not (who.admin or _visible(router, who, root) is not None):
        return None
    return (yield from view_steps(router.tree, overlay, root, max_depth=MAX_DEPTH, max_nodes=MAX_NODES))


def _stamped(router: Router, steps: Generator[None, None, TreeView | None]) -> Generator[None, None, TreeView | None]:
    """The view of ``steps`` with its nodes' clock values as RFC 3339 times."""
    view = yield from steps
    if view is None:
        return None
    offset = _wall_offset(router)
    stack = [view.tree]
    countdown = VIEW_STEP
    while stack:
        node = stack.pop()
        for key in ("created_at", "last_active_at"):
            at = node[key]
            node[key] = None if at is None else rfc3339(offset + at)  # (None: a forgotten root)
        stack.extend(node["children"])
        countdown -= 1
        if not countdown:
            countdown = VIEW_STEP
            yield
    return view


def add_routes(app: web.Application, router: Router, tokens: TokenSet | None) -> None:
    """Mount the sessions API and the tree view on ``app``."""
    app[ROUTER_KEY] = router
    app[AUTH_KEY] = Auth(tokens)
    views_lock(app)
    app.router.add_post("/v1/sessions", create_session)
    app.router.add_get("/v1/sessions", list_sessions)
    app.router.add_get("/v1/sessions/{session}", get_session)
    app.router.add_post("/v1/sessions/{session}/close", close_session)
    app.router.add_get("/v1/trees/{root}", get_tree)
