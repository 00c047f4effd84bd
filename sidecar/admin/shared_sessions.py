"""The sessions API and the tree view when sessions live in a shared store (sidecar.state.redis):
every replica answers for the whole fleet. The handlers of :mod:`sidecar.admin.sessions_api` call
one backend, chosen once: this one (:class:`SharedSessions`) with a shared store; the resource
shapes are those of :mod:`sidecar.admin.memory_sessions`, and errors are
:class:`sidecar.errors.ProxyError` alike.

Creation and close are atomic steps in the store (two replicas racing on one id: one wins); a close
stops every replica admitting the session within the store's event latency, and its end runs once
for the fleet. While the store is unreachable these calls answer 503 ``store_unavailable`` (the
proxy itself goes on serving on local state).
"""

from __future__ import annotations

import uuid
from typing import Any

from sidecar import errors
from sidecar.admin.views import MAX_DEPTH, MAX_NODES
from sidecar.auth import Principal
from sidecar.context import EndReason
from sidecar.router import Router
from sidecar.sessions import SessionStatus, rfc3339
from sidecar.state.records import Record
from sidecar.state.redis import RedisState, StoreUnavailable, _api_session
from sidecar.state.views import node_dict, tree_view

STORE_UNAVAILABLE = errors.STORE_UNAVAILABLE


def _state(router: Router) -> RedisState:
    state = router.state
    assert isinstance(state, RedisState)
    return state


def _store_down() -> errors.ProxyError:
    return errors.ProxyError(STORE_UNAVAILABLE, "the shared session store is unreachable; retry")


async def _record(router: Router, session: str) -> Record | None:
    try:
        return (await _state(router).fetch([session]))[session]
    except StoreUnavailable:
        raise _store_down() from None


def resource(router: Router, rec: Record) -> dict[str, Any]:
    """The API resource of a stored session (API-created or learned from traffic): the same
    fields either way."""
    lineage = node_dict(rec, rec.root)
    if rec.api:
        out = _api_session(rec).as_dict()
        out["origin"] = "api"
        for key in (
            "root",
            "turns",
            "in_flight",
            "final_turn_seen",
            "placeholder",
            "end_reason",
            "workers",
            "affinity",
            "prompt_cache",
        ):
            out[key] = lineage[key]
        return out
    closed = rec.closing or rec.ended
    idle = router.config.sessions.idle_ttl_seconds
    return {
        "id": rec.id,
        "deployment": rec.deployment,
        "workspace": None,
        "status": SessionStatus.CLOSED.value if closed else SessionStatus.ACTIVE.value,
        "origin": "traffic",
        "parent": rec.parent,
        "ttl_seconds": idle,
        "created_at": rfc3339(rec.created),
        "last_active_at": rfc3339(rec.last_active),
        "expires_at": None if closed else rfc3339(rec.last_active + idle),
        "ended_at": None,
        "root": rec.root,
        "turns": rec.turns,
        "in_flight": rec.in_flight,
        "final_turn_seen": rec.final_seen,
        "placeholder": rec.placeholder,
        "end_reason": lineage["end_reason"],
        "workers": lineage["workers"],
        "affinity": lineage["affinity"],
        "prompt_cache": lineage["prompt_cache"],
    }


def _sees(who: Principal, rec: Record) -> bool:
    """API sessions: their workspace's tokens and admins; traffic sessions: admins only."""
    return who.sees(rec.workspace) if rec.api else who.admin


class SharedSessions:
    """The sessions API's answers from the shared store: every replica answers for the fleet."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def get(self, who: Principal, session: str) -> dict[str, Any] | None:
        router = self.router
        rec = await _record(router, session)
        if rec is None or not _sees(who, rec) or (rec.placeholder and not rec.api):
            return None
        return resource(router, rec)

    async def create(
        self, who: Principal, *, session: str | None, deployment: str, ttl: float | None, parent: str | None
    ) -> dict[str, Any]:
        router = self.router
        state = _state(router)
        api_cfg = router.store.cfg
        prec = None
        if parent is not None:
            prec = await _record(router, parent)
            if (
                prec is None
                or not prec.api
                or not who.sees(prec.workspace)
                or not prec.live
                or prec.deployment != deployment
            ):
                raise errors.ProxyError(
                    errors.PARENT_NOT_FOUND, f"parent: no active session of deployment {deployment!r} that you created"
                )
        sid = session or str(uuid.uuid4())
        if ttl is None:
            ttl = api_cfg.default_ttl_seconds
        now = state.wall()
        try:
            rec = await state.create_api(
                session=sid,
                deployment=deployment,
                workspace=who.workspace,
                parent=parent,
                root=None if prec is None else prec.root,  # the session joins its parent's tree
                ttl=ttl,
                now=now,
            )
        except StoreUnavailable:
            raise _store_down() from None
        if rec == -2:
            raise errors.ProxyError(
                errors.SESSION_LIMIT_REACHED, f"{api_cfg.max_sessions} active sessions exist already; close some"
            )
        if not isinstance(rec, Record):
            raise errors.ProxyError(errors.SESSION_EXISTS, "a session with this id exists or was closed recently")
        router.store.cache(_api_session(rec))
        return resource(router, rec)

    async def close(self, who: Principal, session: str) -> dict[str, Any] | None:
        """Close a session for the whole fleet (idempotent); None when the caller may not see it."""
        router = self.router
        rec = await _record(router, session)
        if rec is None or not _sees(who, rec) or rec.placeholder:
            return None
        if not rec.ended and not rec.closing:
            try:
                await _state(router).close(session, EndReason.API_CLOSED.value)  # here at once, elsewhere by event
            except StoreUnavailable:
                raise _store_down() from None
        rec = await _record(router, session)
        return None if rec is None else resource(router, rec)

    async def page(
        self, who: Principal, *, after: int, limit: int, deployment: str | None, status: SessionStatus | None
    ) -> tuple[list[dict[str, Any]], int | None]:
        """One page of API sessions in creation order, and the next cursor (None on the last page)."""
        router = self.router
        state = _state(router)
        out: list[dict[str, Any]] = []
        for _ in range(20):  # filtered pages may come out short: read on, within bounds
            try:
                batch = await state.api_page(after, limit)
            except StoreUnavailable:
                raise _store_down() from None
            if not batch:
                return out, None
            for rec in batch:
                after = rec.seq
                if not who.sees(rec.workspace) or (deployment is not None and rec.deployment != deployment):
                    continue
                res = resource(router, rec)
                if status is not None and res["status"] != status.value:
                    continue
                out.append(res)
                if len(out) == limit:
                    return out, after
            if len(batch) < limit:
                return out, None
        return out, after

    async def tree(self, who: Principal, session: str) -> dict[str, Any] | None:
        router = self.router
        try:
            built = await tree_view(_state(router), session, max_depth=MAX_DEPTH, max_nodes=MAX_NODES)
        except StoreUnavailable:
            raise _store_down() from None
        if built is None:
            return None
        top, _ = built
        if not who.admin:
            root = await _record(router, top["session"])
            if root is None or not root.api or not who.sees(root.workspace):
                return None  # only the workspace owning the tree's root session sees it
        return top
