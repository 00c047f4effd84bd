"""The sessions API and the tree view when sessions live in this process (``state.url:
memory://``): the API session table and the lineage tree are the truth. The handlers of
:mod:`sidecar.admin.sessions_api` call one backend, chosen once: this one, or
:mod:`sidecar.admin.shared_sessions` with a shared store; both answer the same resources and
raise :class:`sidecar.errors.ProxyError` for an error answer.

Every call is synchronous with respect to the router (no await between a check and its
effect), so a close is ordered with every request admission on the event loop. The tree view
is the exception: it is built in slices that let the proxy run in between
(:mod:`sidecar.admin.views`).
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

from sidecar import errors
from sidecar.admin.api_views import API_END_REASONS, api_root, overlay_steps, view_steps
from sidecar.admin.views import MAX_DEPTH, MAX_NODES, run_sliced
from sidecar.auth import Principal
from sidecar.lineage import VIEW_STEP, TreeView, prompt_cache
from sidecar.router import Router
from sidecar.sessions import ApiSession, SessionExists, SessionLimitReached, SessionStatus, rfc3339


class MemorySessions:
    """The sessions API's answers from this process's API table and lineage tree."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def create(
        self, who: Principal, *, session: str | None, deployment: str, ttl: float | None, parent: str | None
    ) -> dict[str, Any]:
        router = self.router
        root = None
        if parent is not None:
            prec = _visible(router, who, parent)
            if prec is None or prec.status is not SessionStatus.ACTIVE or prec.deployment != deployment:
                raise errors.ProxyError(
                    errors.PARENT_NOT_FOUND, f"parent: no active session of deployment {deployment!r} that you created"
                )
            root = api_root(router.tree, router.store, prec)  # the session joins its parent's tree
        if session is not None and router.tree.bound_deployment(session) is not None:
            raise errors.ProxyError(errors.SESSION_EXISTS, "a live session with this id exists (learned from traffic)")
        try:
            rec = router.store.create(
                deployment=deployment, workspace=who.workspace, session_id=session, ttl=ttl, parent=parent, root=root
            )
        except SessionExists:
            raise errors.ProxyError(
                errors.SESSION_EXISTS, "a session with this id exists or was closed recently"
            ) from None
        except SessionLimitReached as exc:
            raise errors.ProxyError(
                errors.SESSION_LIMIT_REACHED, f"{exc.args[0]} active sessions exist already; close some"
            ) from None
        return api_resource(router, rec)

    async def page(
        self, who: Principal, *, after: int, limit: int, deployment: str | None, status: SessionStatus | None
    ) -> tuple[list[dict[str, Any]], int | None]:
        router = self.router
        page, nxt = router.store.page(
            workspace=who.workspace,
            all_workspaces=who.admin,
            deployment=deployment,
            status=status,
            after=after,
            limit=limit,
        )
        return [api_resource(router, r) for r in page], nxt

    async def get(self, who: Principal, session: str) -> dict[str, Any] | None:
        router = self.router
        rec = _visible(router, who, session)
        if rec is not None:
            return api_resource(router, rec)
        node = _traffic_node(router, who, session)
        return None if node is None else traffic_resource(router, node)

    async def close(self, who: Principal, session: str) -> dict[str, Any] | None:
        router = self.router
        if _visible(router, who, session) is not None:
            rec = router.close_api_session(session)
            assert rec is not None
            return api_resource(router, rec)
        node = _traffic_node(router, who, session)
        if node is None or node["placeholder"]:
            return None
        router.close_session(session)
        return traffic_resource(router, router.tree.get(session) or {**node, "closed": True})

    async def tree(self, who: Principal, session: str) -> dict[str, Any] | None:
        view, _ = await run_sliced(_stamped(self.router, _tree_steps(self.router, who, session)))
        return None if view is None else view.tree


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
    "prompt_cache": prompt_cache(0, 0, 0, 0),
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
        out["prompt_cache"] = node["prompt_cache"]
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
        "prompt_cache": node["prompt_cache"],
    }


def _visible(router: Router, who: Principal, session: str) -> ApiSession | None:
    rec = router.store.get(session)
    return rec if rec is not None and who.sees(rec.workspace) else None


def _traffic_node(router: Router, who: Principal, sid: str) -> dict[str, Any] | None:
    """The lineage node of a session learned from traffic (not an API session); admins only."""
    if router.store.get(sid) is not None or not who.admin:
        return None
    return router.tree.get(sid)


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
