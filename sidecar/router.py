"""The routing decision: identity -> lineage -> deployment -> mode.

Engines call :meth:`Router.route` with a request head, forward what the returned
:class:`Decision` says, call :meth:`Router.transform_body` when ``decision.needs_body``, and
call :meth:`Router.finish` exactly once after the last response byte reached the client (or
the request failed). Everything here is synchronous: no I/O, no awaits, so the lineage tree
needs no locks. End-of-session I/O is handed to ``effects`` for the proxy layer to perform.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from sidecar import errors
from sidecar.config import Config
from sidecar.deployments import Deployment, Upstream
from sidecar.identity import Identity, IdentityReader
from sidecar.lineage import Ended, SessionTree, Turn, TurnOutcome
from sidecar.metrics import Metrics
from sidecar.modes.base import EndAction, RoutingContext, SessionEnd

log = logging.getLogger("sidecar.router")

EffectSink = Callable[[Deployment, EndAction, str], None]


@dataclass(slots=True)
class RequestHead:
    """What an engine hands the router: the parts of a request head routing may depend on."""

    method: str
    target: str
    headers: Mapping[str, str]  # lower-case name -> first value


@dataclass(slots=True)
class Decision:
    """How to forward one request. ``add`` headers go after the client's (minus ``strip``)."""

    deployment: Deployment
    upstream: Upstream
    strip: frozenset[str]
    add: tuple[tuple[str, str], ...]
    needs_body: bool
    ctx: RoutingContext | None
    turn: Turn | None
    finished: bool = False


_NO_STRIP: frozenset[str] = frozenset()


class Router:
    """Owns identity reading, the session tree and the deployments' modes."""

    def __init__(self, config: Config, metrics: Metrics, *, tree: SessionTree | None = None,
                 effects: EffectSink | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.identity = IdentityReader(config.identity)
        self.deployments = [Deployment.from_config(d) for d in config.resolved_deployments()]
        self.default = self.deployments[0]
        s = config.sessions
        self.tree = tree or SessionTree(idle_ttl=s.idle_ttl_seconds, max_live=s.max_live_sessions,
                                        tombstone_max=s.tombstone_max, tombstone_ttl=s.tombstone_ttl_seconds)
        self.effects = effects
        metrics.watch_tree(self.tree)

    # -- request path -------------------------------------------------------------------------

    def route(self, head: RequestHead) -> Decision:
        """Decide how to forward a request. Raises :class:`errors.ProxyError` to answer it directly."""
        ident = self.identity.read(head.headers)
        dep = self.default
        if ident.session is None:
            return Decision(dep, dep.pick_upstream(None), _NO_STRIP, (), False, None, None)
        return self._route_session(dep, ident, head.headers)

    def _route_session(self, dep: Deployment, ident: Identity, headers: Mapping[str, str]) -> Decision:
        assert ident.session is not None
        turn, evicted = self.tree.begin(ident.session, parent=ident.parent, root_hint=ident.root,
                                        final=ident.final, deployment=dep.name)
        if evicted:
            self._ended(evicted)
        f = turn.facts
        ctx = RoutingContext(session=f.session, parent=f.parent, root=f.root, is_final_turn=f.is_final_turn,
                             is_parent_final=f.is_parent_final, is_tree_final=f.is_tree_final, turn=f.turn,
                             deployment=dep.name)
        decision = Decision(dep, dep.pick_upstream(f.root), dep.strip_headers, (), False, ctx, turn)
        mode = dep.mode
        if mode is None:
            return decision
        try:
            add = tuple(mode.request_headers(ctx))
        except Exception as exc:
            self._mode_failed(decision, "request_headers", exc)
        if add and dep.trust_client_headers:
            # A trusted client's own copy wins: keep it and add nothing under that name.
            add = tuple((n, v) for n, v in add if n.lower() not in headers)
        if add:
            decision.add = add
            self.metrics.headers_injected_for(dep.mode_name).inc()
        decision.needs_body = mode.mutates_body
        return decision

    def transform_body(self, decision: Decision, body: bytes) -> bytes:
        """The body to forward for a ``needs_body`` decision; unparseable bodies pass unchanged."""
        dep = decision.deployment
        mode = dep.mode
        assert mode is not None and decision.ctx is not None
        counter = self.metrics.body_rewrites
        try:
            obj: Any = orjson.loads(body)
        except orjson.JSONDecodeError:
            obj = _INVALID
        if not isinstance(obj, dict):
            outcome = "passthrough_invalid_json" if obj is _INVALID else "passthrough_not_object"
            if dep.reject_non_object_body:
                counter.labels(dep.mode_name, "rejected").inc()
                self.metrics.rejected.labels("non_object_body").inc()
                self.finish(decision, TurnOutcome.UPSTREAM_FAILED)
                raise errors.ProxyError(
                    errors.INVALID_JSON_BODY,
                    f"deployment {dep.name!r} (mode {dep.mode_name}) needs a JSON object request body",
                    deployment=dep.name)
            counter.labels(dep.mode_name, outcome).inc()
            return body
        try:
            new = mode.transform_body(decision.ctx, obj)
        except Exception as exc:
            self._mode_failed(decision, "transform_body", exc)
        counter.labels(dep.mode_name, "rewritten").inc()
        return orjson.dumps(new)

    def _mode_failed(self, decision: Decision, hook: str, exc: Exception) -> Any:
        dep = decision.deployment
        self.metrics.plugin_errors.labels(dep.mode_name, hook).inc()
        log.error("mode %s failed in %s: %r", dep.mode_name, hook, exc,
                  extra={"deployment": dep.name, "mode": dep.mode_name, "hook": hook})
        self.finish(decision, TurnOutcome.UPSTREAM_FAILED)
        raise errors.ProxyError(errors.MODE_ERROR, f"routing mode {dep.mode_name!r} failed in {hook}: {exc}",
                                mode=dep.mode_name, deployment=dep.name) from exc

    def finish(self, decision: Decision, outcome: TurnOutcome) -> None:
        """The request is over (last byte written, failed, or abandoned). Idempotent."""
        if decision.finished:
            return
        decision.finished = True
        if decision.turn is not None:
            ended = self.tree.end_turn(decision.turn, outcome)
            if ended:
                self._ended(ended)

    # -- session lifecycle ------------------------------------------------------------------

    def expire(self) -> None:
        """Idle sweep; the app calls this periodically."""
        ended = self.tree.expire()
        if ended:
            self._ended(ended)

    def shutdown(self) -> None:
        """End every live session (after the drain)."""
        ended = self.tree.shutdown()
        if ended:
            self._ended(ended)

    def close_session(self, session: str) -> None:
        ended = self.tree.close(session)
        if ended:
            self._ended(ended)

    def deployment(self, name: str) -> Deployment | None:
        for d in self.deployments:
            if d.name == name:
                return d
        return None

    def _ended(self, ended: list[Ended]) -> None:
        for e in ended:
            self.metrics.sessions_ended.labels(str(e.reason)).inc()
            dep = self.deployment(e.deployment)
            if dep is None or dep.mode is None:
                continue
            end = SessionEnd(session=e.session, parent=e.parent, root=e.root, deployment=e.deployment,
                             reason=str(e.reason), turns=e.turns)
            try:
                actions = tuple(dep.mode.on_session_end(end))
            except Exception as exc:  # a broken hook never stops cleanup of other sessions
                self.metrics.plugin_errors.labels(dep.mode_name, "on_session_end").inc()
                log.error("mode %s failed in on_session_end: %r", dep.mode_name, exc,
                          extra={"deployment": dep.name, "mode": dep.mode_name, "hook": "on_session_end"})
                continue
            if actions and self.effects is not None:
                for action in actions:
                    self.effects(dep, action, e.root)


_INVALID = object()
