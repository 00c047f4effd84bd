"""The routing decision: identity -> deployment -> session admission -> lineage -> mode.

Engines call :meth:`Router.route` with a request head, forward what the returned
:class:`Decision` says, call :meth:`Router.transform_body` when ``decision.needs_body``, and
call :meth:`Router.finish` exactly once after the last response byte reached the client (or
the request failed). Everything here is synchronous: no I/O, no awaits, so the lineage tree and
the API session store need no locks, and a sessions-API close is ordered with every admission.

A request's deployment is, in order: its session's binding (an API session's deployment, or the
deployment of the live session's first request), the selector header (``deployment_header``),
the body's ``model`` (only when at least two deployments list models, the head declares a body,
and nothing before decided), the default. A selector or model naming another deployment than
the binding answers 409 ``deployment_conflict``. Admission then applies the session rules
(closed/expired API sessions: 410; strict deployments: API sessions only) and begins the turn.

Two phases: when the decision needs the body (to pick a deployment by model, or because the
deployment's mode rewrites bodies) ``route`` only validates what the head allows and returns a
decision whose routing fields are provisional; admission happens in ``transform_body``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from sidecar import errors
from sidecar import headers as h
from sidecar.config import TOKEN_RE, Config
from sidecar.deployments import Deployment, Upstream
from sidecar.identity import Identity, IdentityReader
from sidecar.lineage import EndReason, Ended, SessionTree, Turn, TurnOutcome
from sidecar.metrics import Metrics
from sidecar.modes.base import EndAction, SessionEnd
from sidecar.modes.context import RoutingContext
from sidecar.sessions import ApiSession, SessionStatus, SessionStore

log = logging.getLogger("sidecar.router")

EffectSink = Callable[[Deployment, EndAction, str], None]

# Sessions one idle sweep ends at most before it yields the event loop (a few ms of work).
EXPIRE_BATCH = 1000
# Worker ids are interned so every session's history shares one string per worker.
MAX_INTERNED_WORKERS = 4096


# The request path's records drop slots=True: compiled (router.pxd), they are extension types.
@dataclass
class RequestHead:
    """What an engine hands the router: the parts of a request head routing may depend on."""

    method: str
    target: str
    headers: Mapping[str, str]  # lower-case name -> first value


@dataclass
class _Pending:
    """What ``route`` learned from the head of a request whose admission waits for its body."""

    ident: Identity
    headers: Mapping[str, str]
    selected: Deployment | None  # named by the selector header
    decided: Deployment | None  # by binding or selector; None: by model, else the default


@dataclass
class Decision:
    """How to forward one request. ``add`` headers go after the client's (minus ``strip``).

    While ``needs_body`` is set and ``transform_body`` has not run yet, only ``max_body_bytes``
    is final and ``deployment`` is provisional (use it for error labels only); ``upstream``,
    ``strip``, ``add``, ``ctx`` and ``turn`` are filled in by ``transform_body``.
    ``api_session`` and ``pending`` belong to the router.
    """

    deployment: Deployment
    upstream: Upstream
    strip: frozenset[str]
    add: tuple[tuple[str, str], ...]
    needs_body: bool
    ctx: RoutingContext | None
    turn: Turn | None
    finished: bool = False
    # Buffer at most this many body bytes (413 above it).
    max_body_bytes: int = 0
    api_session: ApiSession | None = None
    pending: _Pending | None = None
    # The client's X-Request-ID, for log lines (see :meth:`log_fields`).
    request_id: str | None = None
    # The upstream's response status once its head arrived (0 before).
    status: int = 0

    def log_fields(self) -> dict[str, Any]:
        """What every log line about this request carries: request id and deployment."""
        return {"request_id": self.request_id, "deployment": self.deployment.name,
                "mode": self.deployment.mode_name}


class Router:
    """Owns identity reading, deployment choice, API-session admission, the session tree and
    the deployments' modes."""

    def __init__(self, config: Config, metrics: Metrics, *, tree: SessionTree | None = None,
                 store: SessionStore | None = None, effects: EffectSink | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.identity = IdentityReader(config.identity, config.sessions.max_id_bytes)
        s = config.sessions
        self.deployments = [
            Deployment.from_config(d, selector_header=config.deployment_header,
                                   identity_headers=self.identity.header_names,
                                   max_overrides=s.max_live_sessions)
            for d in config.resolved_deployments()]
        for d in self.deployments:
            d.stats = metrics.for_deployment(d.name, d.mode_name)
        self._by_name = {d.name: d for d in self.deployments}
        self.default = self._by_name[config.default_deployment or self.deployments[0].name]
        self._selector = config.deployment_header.lower()
        self._primary_session_header = config.identity.session[0] if config.identity.session else ""
        # model -> deployment; consulted only when at least two deployments list models
        self._by_model = {m: d for d in self.deployments for m in sorted(d.models)}
        self._route_by_model = sum(1 for d in self.deployments if d.models) > 1
        self._selection_body_limit = max(d.limits.max_body_bytes for d in self.deployments)
        self._single = len(self.deployments) == 1
        self._body_identity = self.identity.reads_body
        self._worker_headers = tuple(n.lower() for n in config.affinity.worker_headers)
        self._workers: dict[str, str] = {}  # interned worker ids (a small set), bounded
        self.tree = tree or SessionTree(idle_ttl=s.idle_ttl_seconds, max_live=s.max_live_sessions,
                                        tombstone_max=s.tombstone_max, tombstone_ttl=s.tombstone_ttl_seconds)
        self.store = store or SessionStore(s.api)
        self._api_sessions = self.store.records  # the hot path reads it without a call
        self.effects = effects
        metrics.watch_tree(self.tree)
        metrics.watch_deployments(self.deployments, self.store)

    # -- request path -------------------------------------------------------------------------

    def route(self, head: RequestHead) -> Decision:
        """Decide how to forward a request. Raises :class:`errors.ProxyError` to answer it directly."""
        # Flattened: this runs once per request. Hot-path decisions are built positionally (a
        # class called with keywords costs a dict per call); the request id is read once.
        headers = head.headers
        request_id = headers.get(_REQUEST_ID)
        ident = self.identity.read(headers)
        session = ident.session
        selector = headers.get(self._selector)
        selected = None if selector is None else self._selected(selector)
        body_identity = session is None and self._body_identity
        if session is None and selected is None and not self._route_by_model and not body_identity:
            dep = self.default  # the common sessionless case, kept cheap
            if dep.strict:
                raise _session_required(dep)
            return Decision(dep, dep.pick_upstream(None), dep.strip_sessionless, (), False, None, None,
                            False, dep.max_body_bytes, None, None, request_id)
        if body_identity and _declares_body(head):
            # The session is named by the body (configured body signals): admission waits for it.
            dep = selected or self.default
            limit = self._selection_body_limit if self._route_by_model and selected is None else \
                dep.max_body_bytes
            return Decision(dep, dep.upstreams[0], dep.strip_sessionless, (), True, None, None,
                            max_body_bytes=limit, pending=_Pending(ident, headers, selected, selected),
                            request_id=request_id)
        rec = self._api_sessions.get(session) if session is not None and self._api_sessions else None
        # One deployment: binding, selector and model can only name it (an unknown name was refused).
        decided = self.default if self._single else self._choose(session, rec, selected, None)
        if decided is None and self._route_by_model and _declares_body(head):
            return Decision(self.default, self.default.upstreams[0], self.default.strip_sessionless, (), True,
                            None, None, max_body_bytes=self._selection_body_limit,
                            pending=_Pending(ident, headers, selected, None), request_id=request_id)
        dep = decided or self.default
        if rec is not None or dep.strict:
            self._check_session(dep, session, rec)  # refuse early, before any body is read
        if dep.rewrites_body and session is not None and _declares_body(head):
            return Decision(dep, dep.upstreams[0], dep.strip_sessionless, (), True, None, None, False,
                            dep.max_body_bytes, None, _Pending(ident, headers, selected, decided), request_id)
        return self._admit(dep, ident, headers, rec, request_id)

    def transform_body(self, decision: Decision, body: bytes) -> bytes:
        """Second phase of a ``needs_body`` decision: choose the deployment by the body's model
        when still open, admit the request, and return the body to forward (rewritten by a body
        mode; otherwise ``body`` itself). Raises :class:`errors.ProxyError` to answer directly."""
        pending = decision.pending
        assert pending is not None, "transform_body called for a decision that needs no body"
        decision.pending = None
        obj: Any = _UNPARSED
        model_dep: Deployment | None = None
        ident = pending.ident
        if self._route_by_model or (ident.session is None and self.identity.reads_body):
            obj = _parse(body)
        if self._route_by_model:
            model = obj.get("model") if isinstance(obj, dict) else None
            if isinstance(model, str):
                model_dep = self._by_model.get(model)
        if ident.session is None and self.identity.reads_body:
            ident = self.identity.read_body(pending.headers, obj)
        # Re-resolved at admission: the session may have been bound or closed while the body
        # was read.
        rec = self._api_sessions.get(ident.session) if ident.session is not None else None
        if self._single:  # binding, selector and model can only name it (an unknown name was refused)
            dep = self.default
        else:
            dep = self._choose(ident.session, rec, pending.selected, model_dep) or self.default
        decision.deployment = dep
        if len(body) > dep.max_body_bytes:
            raise errors.ProxyError(errors.REQUEST_TOO_LARGE,
                                    f"request body exceeds {dep.max_body_bytes} bytes (deployment {dep.name!r})",
                                    deployment=dep.name, limit=dep.max_body_bytes)
        self._check_session(dep, ident.session, rec)
        admitted = self._admit(dep, ident, pending.headers, rec, decision.request_id)
        decision.deployment = admitted.deployment
        decision.upstream = admitted.upstream
        decision.strip = admitted.strip
        decision.add = admitted.add
        decision.ctx = admitted.ctx
        decision.turn = admitted.turn
        decision.api_session = admitted.api_session
        decision.max_body_bytes = dep.max_body_bytes
        if not admitted.needs_body:
            return body
        return self._rewrite(decision, body, obj)

    def _selected(self, name: str) -> Deployment:
        """The deployment the selector header names (raises for an unknown name)."""
        name = name.strip()
        dep = self._by_name.get(name)
        if dep is None:
            raise errors.ProxyError(errors.UNKNOWN_DEPLOYMENT,
                                    f"header {self.config.deployment_header} names no deployment: {name[:80]!r} "
                                    f"(deployments: {sorted(self._by_name)})", requested_deployment=name[:80])
        return dep

    def binding(self, session: str, rec: ApiSession | None = None) -> Deployment | None:
        """The deployment ``session`` is bound to: its API session's (``rec``, looked up when not
        given), else its live lineage node's."""
        if rec is None:
            rec = self.store.get(session)
        name = rec.deployment if rec is not None else self.tree.bound_deployment(session)
        return None if name is None else self._by_name.get(name)

    def _choose(self, session: str | None, rec: ApiSession | None, selected: Deployment | None,
                model_dep: Deployment | None) -> Deployment | None:
        """Binding, then selector, then model; a later explicit choice contradicting an earlier
        one is a 409. None when none of them decides."""
        bound = self.binding(session, rec) if session is not None else None
        first, how = (bound, "binding") if bound is not None else (selected, "selector")
        if first is None:
            return model_dep
        if bound is not None and selected is not None and selected is not bound:
            raise self._conflict(session, bound, selected, f"header {self.config.deployment_header}")
        if model_dep is not None and model_dep is not first:
            raise self._conflict(session, first, model_dep, "the body's model", how)
        return first

    @staticmethod
    def _conflict(session: str | None, bound: Deployment, requested: Deployment, by: str,
                  how: str = "binding") -> errors.ProxyError:
        if session is not None and how == "binding":
            msg = (f"session {session!r} is bound to deployment {bound.name!r}; the request targets "
                   f"deployment {requested.name!r} by {by}")
        else:
            msg = (f"the request targets deployment {bound.name!r} by header and deployment "
                   f"{requested.name!r} by {by}")
        return errors.ProxyError(errors.DEPLOYMENT_CONFLICT, msg, bound_deployment=bound.name,
                                 requested_deployment=requested.name)

    def _check_session(self, dep: Deployment, session: str | None, rec: ApiSession | None) -> None:
        """The admission rules of the API sessions and strict deployments (``rec``: the API
        session of ``session``, if any)."""
        if session is None:
            if dep.strict:
                raise _session_required(dep)
            return
        if rec is not None and rec.status is not SessionStatus.ACTIVE:
            expired = rec.status is SessionStatus.EXPIRED
            raise errors.ProxyError(errors.SESSION_EXPIRED if expired else errors.SESSION_CLOSED,
                                    f"session {session!r} is {rec.status.value}", deployment=rec.deployment)
        if rec is None and dep.strict:
            raise errors.ProxyError(errors.SESSION_NOT_FOUND,
                                    f"deployment {dep.name!r} is strict: it only accepts sessions created "
                                    "through the sessions API, and this one is unknown", deployment=dep.name)

    def _admit(self, dep: Deployment, ident: Identity, headers: Mapping[str, str],
               rec: ApiSession | None, request_id: str | None) -> Decision:
        """Admit a request to ``dep`` (after :meth:`_check_session`, in the same synchronous
        step): begin its turn, ask the mode."""
        session = ident.session
        if session is None:
            return Decision(dep, dep.pick_upstream(None), dep.strip_sessionless, (), False, None, None,
                            False, dep.max_body_bytes, None, None, request_id)
        parent, root_hint = ident.parent, ident.root
        if rec is not None:
            self.store.begin(rec)
            if dep.strict or rec.parent is not None:
                parent, root_hint = rec.parent, None  # the API's lineage wins
        turn, evicted = self.tree.begin(session, parent=parent, root_hint=root_hint,
                                        final=ident.final, deployment=dep.name)
        if evicted:
            self._ended(evicted)
        # Positional: RoutingContext and Decision are built once per request of a session.
        f = turn.facts
        ctx = RoutingContext(f.session, f.parent, f.root, f.is_final_turn, f.is_parent_final, f.is_tree_final,
                             f.turn, dep.name, f.mode_state)
        upstream = dep.only_upstream or dep.pick_upstream(f.root)
        # The request id is set before mode hooks can fail (their error log carries it).
        decision = Decision(dep, upstream, dep.strip_headers, (), False, ctx, turn,
                            False, dep.max_body_bytes, rec, None, request_id)
        mode = dep.mode
        if mode is None:
            if dep.strict and self._primary_session_header:
                decision.add = ((self._primary_session_header, f.session),)  # the validated id
            return decision
        try:
            add = tuple(mode.request_headers(ctx))  # no copy when the mode returned a tuple
            if add:
                _check_added(add)
        except Exception as exc:
            self._mode_failed(decision, "request_headers", exc)
        if add and dep.trust_client_headers:
            # A trusted client's own copy wins: keep it and add nothing under that name.
            add = _not_sent_by_client(add, headers)
        if add:
            decision.add = add
            dep.stats.headers_injected.inc()  # type: ignore[union-attr]
        decision.needs_body = mode.mutates_body
        return decision

    def _rewrite(self, decision: Decision, body: bytes, obj: Any) -> bytes:
        """The body-mode rewrite of an admitted request; unparseable bodies pass unchanged."""
        dep = decision.deployment
        mode = dep.mode
        assert mode is not None and decision.ctx is not None
        if obj is _UNPARSED:
            obj = _parse(body)
        if not isinstance(obj, dict):
            counter = self.metrics.body_rewrites
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
        dep.stats.rewritten().inc()  # type: ignore[union-attr]
        return orjson.dumps(new)

    def on_response(self, decision: Decision, status: int, headers: Mapping[str, str]) -> None:
        """The upstream's response head for ``decision`` arrived (``headers``: lower-case name
        lookup). Records which worker served the turn and lets the mode observe the response."""
        decision.status = status
        turn = decision.turn
        if turn is None:
            return
        dep = decision.deployment
        if dep.observes_responses:
            assert dep.mode is not None and decision.ctx is not None
            try:
                state = dep.mode.on_response(decision.ctx, headers)
            except Exception as exc:  # the response is already on its way: count, never fail it
                self.metrics.plugin_errors.labels(dep.mode_name, "on_response").inc()
                log.error("mode %s failed in on_response: %r", dep.mode_name, exc,
                          extra={**decision.log_fields(), "hook": "on_response"})
                state = None
            if state is not None:
                self.tree.set_mode_state(turn, state)
        for name in self._worker_headers:
            worker = headers.get(name)
            if worker:
                self._record_worker(decision, turn, worker.strip())
                return

    def _record_worker(self, decision: Decision, turn: Turn, worker: str) -> None:
        interned = self._workers.get(worker)
        if interned is None:
            interned = worker
            if len(self._workers) < MAX_INTERNED_WORKERS:
                self._workers[worker] = worker
        outcome, previous = self.tree.record_worker(turn, interned)
        self.metrics.affinity_turn(decision.deployment.name, outcome).inc()
        if outcome == "moved":
            extra: dict[str, Any] = {"event": "moved", **decision.log_fields(),
                                     "from_worker": previous, "to_worker": interned,
                                     "turn": turn.facts.turn}
            if log.isEnabledFor(logging.DEBUG):  # session ids only at debug level
                extra["session"] = turn.facts.session
            log.info("session moved to another worker", extra=extra)

    def upstream_unreachable(self, decision: Decision) -> None:
        """The engine could not connect to ``decision.upstream`` (nothing was sent): mark it
        unhealthy so the tree's next request fails over (see :mod:`sidecar.balancer`)."""
        decision.deployment.balancer.mark_unreachable(decision.upstream)

    def _mode_failed(self, decision: Decision, hook: str, exc: Exception) -> Any:
        dep = decision.deployment
        self.metrics.plugin_errors.labels(dep.mode_name, hook).inc()
        log.error("mode %s failed in %s: %r", dep.mode_name, hook, exc, extra={**decision.log_fields(), "hook": hook})
        self.finish(decision, TurnOutcome.UPSTREAM_FAILED)
        raise errors.ProxyError(errors.MODE_ERROR, f"routing mode {dep.mode_name!r} failed in {hook}: {exc}",
                                mode=dep.mode_name, deployment=dep.name) from exc

    def finish(self, decision: Decision, outcome: TurnOutcome) -> None:
        """The request is over (last byte written, failed, or abandoned). Idempotent."""
        if decision.finished:
            return
        decision.finished = True
        if log.isEnabledFor(logging.DEBUG):  # the access log: debug level (it names sessions)
            ctx = decision.ctx
            log.debug("request finished", extra={
                "event": "request", **decision.log_fields(), "status": decision.status, "outcome": str(outcome),
                "session": ctx.session if ctx else None, "turn": ctx.turn if ctx else None})
        if decision.api_session is not None:
            self.store.end(decision.api_session)
        if decision.turn is not None:
            ended = self.tree.end_turn(decision.turn, outcome)
            if ended:
                self._ended(ended)

    # -- session lifecycle ------------------------------------------------------------------

    def expire(self, limit: int = EXPIRE_BATCH) -> bool:
        """Idle sweep of the tree and of API sessions, at most ``limit`` sessions each; the app
        calls this periodically, and again at once while it returns True (work left)."""
        ended, more = self.tree.expire(limit)
        for rec in self.store.expire():
            ended += self.tree.close(rec.id, EndReason.IDLE_EXPIRED)
        if ended:
            self._ended(ended)
        return more

    def shutdown(self) -> None:
        """End every live session (after the drain)."""
        ended = self.tree.shutdown()
        if ended:
            self._ended(ended)

    def close_session(self, session: str) -> None:
        """End ``session`` in the lineage tree (API close); in-flight requests finish first."""
        ended = self.tree.close(session)
        if ended:
            self._ended(ended)

    def close_api_session(self, session: str) -> ApiSession | None:
        """Close an API session (idempotent) and its lineage node. Once this returned, no request
        of ``session`` is admitted; requests already admitted finish. None if unknown."""
        result = self.store.close(session)
        if result is None:
            return None
        rec, changed = result
        if changed:
            self.close_session(session)
        return rec

    def deployment(self, name: str) -> Deployment | None:
        return self._by_name.get(name)

    def _ended(self, ended: Sequence[Ended]) -> None:
        for e in ended:
            dep = self.deployment(e.deployment)
            # The label only takes configured names (a closed set).
            self.metrics.sessions_ended.labels(dep.name if dep is not None else "unknown", str(e.reason)).inc()
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
        for e in ended:
            dep = self._by_name.get(e.deployment)
            if dep is not None and dep.balancer.overrides and self.tree.get(e.root) is None:
                dep.balancer.forget(e.root)  # the tree is gone


def _check_added(add: tuple[tuple[str, str], ...]) -> None:
    """Refuse mode output the engines must never write: a name that is not a token or that the
    proxy writes itself (framing, Host, hop-by-hop), a value that would end the field early."""
    for name, value in add:
        ok = _ADDABLE.get(name)
        if ok is None:
            ok = type(name) is str and TOKEN_RE.match(name) is not None and name.lower() not in h.PROXY_OWNED
            if len(_ADDABLE) < MAX_ADDABLE:
                _ADDABLE[name] = ok
        if not ok:
            raise ValueError(f"header name {str(name)[:64]!r} cannot be added by a mode")
        if type(value) is not str or not h.is_field_value(value):
            raise ValueError(f"the value of header {name!r} is not a valid field value")


def _parse(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return _INVALID


def _not_sent_by_client(add: tuple[tuple[str, str], ...], headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The mode's headers minus those the (trusted) client sent itself (a module function: a
    compiled ``cpdef`` method cannot hold this generator's closure)."""
    return tuple((n, v) for n, v in add if n.lower() not in headers)


def _declares_body(head: RequestHead) -> bool:
    """Whether the request may carry a body (what the engines buffer for a ``needs_body`` decision)."""
    if head.method not in ("GET", "HEAD"):
        return True
    length = head.headers.get(_CONTENT_LENGTH)
    return (length is not None and length.strip() not in ("", "0")) or head.headers.get(_TRANSFER_ENCODING) is not None


def _session_required(dep: Deployment) -> errors.ProxyError:
    return errors.ProxyError(errors.SESSION_REQUIRED,
                             f"deployment {dep.name!r} is strict: requests must name a session created through "
                             "the sessions API", deployment=dep.name)


_CONTENT_LENGTH = h.CONTENT_LENGTH.lower()
_REQUEST_ID = h.X_REQUEST_ID.lower()
_TRANSFER_ENCODING = h.TRANSFER_ENCODING.lower()
_INVALID = object()
_UNPARSED = object()
# Header names modes asked to add, checked once each (_check_added); bounded.
_ADDABLE: dict[str, bool] = {}
MAX_ADDABLE = 256
