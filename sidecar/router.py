"""The routing decision: identity -> deployment -> session admission -> lineage -> mode.

Engines call :meth:`Router.route` with a request head and forward what the returned
:class:`Decision` says; when ``decision.needs_body`` they read the body and call
:meth:`Router.transform_body`, whose complete decision replaces the first one (and carries the
body to forward). An engine calls :meth:`Router.finish` exactly once for the decision it holds,
after the last response byte reached the client or once the request failed; a call that raises
returned no decision, and the router has finished whatever it had admitted. Everything here is
synchronous: no I/O, no awaits, so the lineage tree and the API session store need no locks, and a
sessions-API close is ordered with every admission.

A request's deployment is, in order: its session's binding (an API session's deployment, or the
deployment of the live session's first request), the selector header (``deployment_header``),
the body's ``model`` (only when at least two deployments list models, the head declares a body,
and nothing before decided), the default. A selector or model naming another deployment than
the binding answers 409 ``deployment_conflict``. Admission then applies the session rules
(closed/expired API sessions: 410; strict deployments: API sessions only) and begins the turn.

Two phases: when the decision needs the body (to pick a deployment by model, to read body
identity signals, or because the deployment's mode rewrites bodies) ``route`` only validates
what the head allows and returns a decision whose routing fields are provisional; admission
happens in ``transform_body``.

Bodies are read as the client's bytes (:mod:`sidecar.jsonbody`): one strict scan, bounded in size
(``limits.max_parsed_body_bytes``) and depth (``limits.max_json_depth``), locates the top-level
members routing reads; a body mode's patch is spliced into those bytes. A body larger than
:data:`~sidecar.jsonscan.INLINE_BYTES` is scanned and spliced off the event loop: then
``transform_body`` returns :class:`BodyWork` for the engine to run on a worker thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from logging import DEBUG
from typing import Any

import orjson

from sidecar import errors
from sidecar import headers as h
from sidecar.config import Config
from sidecar.context import BodyPatch, EndReason, RoutingContext, SessionEnd, TurnOutcome
from sidecar.deployments import Deployment, Upstream
from sidecar.headers import is_field_value, lookup
from sidecar.identity import Identity, IdentityReader
from sidecar.jsonbody import INVALID, TOO_DEEP, TOO_MANY, RepeatedKeys, ScannedBody, scan_body, splice
from sidecar.jsonscan import INLINE_BYTES, join
from sidecar.lineage import SessionTree, Turn
from sidecar.metrics import Metrics
from sidecar.modes.base import EndAction, Mode
from sidecar.modes.ids import fit_id
from sidecar.responses import FirstBytes
from sidecar.sessions import ApiSession, SessionStatus, SessionStore
from sidecar.state import LoadNeeded, MemoryState, SessionState
from sidecar.validation import TOKEN_RE

log = logging.getLogger("sidecar.router")
# The logger's per-level answers: filled by isEnabledFor, cleared in place by the logging module
# whenever a level changes (empty if a Python lacks it: every check then asks isEnabledFor).
_LOG_CACHE: dict[int, bool] = getattr(log, "_cache", {})


def _debug_on() -> bool:
    """``log.isEnabledFor(DEBUG)``, from the logger's cache when it holds the answer: once per
    request, a dict lookup costs far less than a call into the logging module."""
    if log.disabled:
        return False
    on = _LOG_CACHE.get(DEBUG)
    return log.isEnabledFor(DEBUG) if on is None else on


# Takes one end action of a session: (deployment, action, tree root, called once it ran or was
# given up, or None).
EndActionSink = Callable[[Deployment, EndAction, str, "Callable[[], None] | None"], None]

# Sessions one idle sweep ends at most before it yields the event loop (a few ms of work).
EXPIRE_BATCH = 1000
# Worker ids are interned so every session's history shares one string per worker.
MAX_INTERNED_WORKERS = 4096
# A worker id longer than this (UTF-8 bytes) is kept and logged in its fitted form (a prefix and
# a digest): it comes from an upstream's header, and the tree keeps it per session.
MAX_WORKER_BYTES = 256
# Threads an engine runs BodyWork on (see body_pool): large bodies only, a few at a time.
BODY_THREADS = 2
# The session a Responses request starts when it continues no known response: this prefix and
# 128 random bits (every replica learns it from the store, with the response ids it produced).
CHAIN_PREFIX = "chain-"
# A body's `model` longer than this names no deployment.
MAX_MODEL_BYTES = 4096
# Top-level keys a scan locates at most (the scanner's bound).
MAX_SCAN_NAMES = 16


# The request path's records drop slots=True: compiled (router.pxd), they are extension types.
@dataclass
class RequestHead:
    """What an engine hands the router: the parts of a request head routing may depend on."""

    method: str
    headers: Mapping[str, str]  # lower-case name -> first value


@dataclass
class _Pending:
    """What ``route`` learned from the head of a request whose admission waits for its body."""

    ident: Identity
    headers: Mapping[str, str]
    selected: Deployment | None  # named by the selector header
    decided: Deployment | None  # by binding or selector; None: by model, else the default


class _Admission:
    """The router's hold on an admitted request of a session: its turn in the lineage tree and
    its API session, released once by :meth:`Router.finish`. Made by :func:`_admitted`."""

    __slots__ = ("turn", "api_session")

    turn: Turn
    api_session: ApiSession | None


@dataclass
class Decision:
    """How to forward one request: to ``upstream`` of ``deployment``, with the client's headers
    minus ``drop`` (lower-case names), then ``add``.

    A decision with ``needs_body`` is provisional: only ``max_body_bytes`` (then the limit for
    bodies the sidecar reads as JSON) is final, and ``deployment`` labels errors. The engine
    reads the body and calls :meth:`Router.transform_body`, which returns the complete decision
    whose ``body`` is the body to forward. ``_held`` is the router's (what :meth:`Router.finish`
    releases); engines never read it. Built only by :func:`_decision`.
    """

    deployment: Deployment
    upstream: Upstream
    drop: frozenset[str]
    add: tuple[tuple[str, str], ...]
    needs_body: bool
    ctx: RoutingContext | None
    # Buffer at most this many body bytes (413 above it).
    max_body_bytes: int
    # The client's X-Request-ID, for log lines (see :meth:`log_fields`).
    request_id: str | None
    # The body to forward (set by transform_body; None when the engine streams the client's).
    body: bytes | None = None
    # The upstream's response status once its head arrived (0 before).
    status: int = 0
    _held: _Pending | _Admission | None = None
    # The request was chained by the body signal previous_response_id: the engine hands the
    # response body's first bytes to Router.response_start (see Router.reads_response).
    reads_response_id: bool = False
    # What response_start gathered of them so far (the router's).
    first_bytes: FirstBytes | None = None

    def log_fields(self) -> dict[str, Any]:
        """What every log line about this request carries: request id and deployment."""
        return {"request_id": self.request_id, "deployment": self.deployment.name, "mode": self.deployment.mode_name}


# The decisions' constructors. Built field by field: compiled, an allocation and stores (calling
# a class packs its arguments into a tuple and parses them), and these run once per request.


def _decision(
    dep: Deployment,
    upstream: Upstream,
    drop: frozenset[str],
    needs_body: bool,
    ctx: RoutingContext | None,
    limit: int,
    request_id: str | None,
    held: _Pending | _Admission | None,
) -> Decision:
    decision = Decision.__new__(Decision)
    decision.deployment = dep
    decision.upstream = upstream
    decision.drop = drop
    decision.add = ()
    decision.needs_body = needs_body
    decision.ctx = ctx
    decision.max_body_bytes = limit
    decision.request_id = request_id
    decision.body = None
    decision.status = 0
    decision._held = held
    decision.reads_response_id = False
    decision.first_bytes = None
    return decision


def _sessionless(dep: Deployment, request_id: str | None) -> Decision:
    """A request of no session: forwarded as is (minus the deployment's sessionless drops)."""
    return _decision(
        dep, dep.pick_upstream(None), dep.drop_sessionless, False, None, dep.max_body_bytes, request_id, None
    )


def _awaiting_body(dep: Deployment, limit: int, pending: _Pending, request_id: str | None) -> Decision:
    """A provisional decision: admission waits for the body (``limit``: the bytes to read at most)."""
    return _decision(dep, dep.upstreams[0], dep.drop_sessionless, True, None, limit, request_id, pending)


def _admitted(
    dep: Deployment, upstream: Upstream, ctx: RoutingContext, turn: Turn, rec: ApiSession | None, request_id: str | None
) -> Decision:
    """An admitted request of a session (its mode's headers and body flag are set after)."""
    admission = _Admission.__new__(_Admission)
    admission.turn = turn
    admission.api_session = rec
    return _decision(dep, upstream, dep.drop, False, ctx, dep.max_body_bytes, request_id, admission)


class BodyWork:
    """Body work the router hands back instead of a decision when the body is large: the engine
    calls ``run()`` on a worker thread (:func:`body_pool`; it only reads its arguments), then
    ``resume(result)`` on the event loop, which returns the complete decision or more work, or
    raises like ``transform_body``. The engine calls exactly one of ``resume`` and
    ``abandon(outcome)``: the latter when ``run`` raised (a defect: answer 500) or the client left
    meanwhile; it releases what the router admitted for the request."""

    __slots__ = ("run", "resume", "abandon")

    def __init__(
        self,
        run: Callable[[], Any],
        resume: Callable[[Any], Decision | BodyWork],
        abandon: Callable[[TurnOutcome], None] | None = None,
    ) -> None:
        self.run = run
        self.resume = resume
        self.abandon = abandon or _nothing_held


def _nothing_held(outcome: TurnOutcome) -> None:
    """The ``abandon`` of body work that runs before admission: nothing to release."""


def body_pool() -> ThreadPoolExecutor:
    """The bounded thread pool an engine runs :class:`BodyWork` on (one per engine; shut it down
    when the engine closes)."""
    return ThreadPoolExecutor(BODY_THREADS, thread_name_prefix="sidecar-body")


# What the scan of a request's body found: the scan, the identity, the model's deployment.
_Read = tuple[ScannedBody, Identity, "Deployment | None"]
# A body rewrite to finish off the event loop: (run on a worker thread, resume with its outcome).
_Steps = tuple[Callable[[], Any], Callable[[Any], bytes]]


class Router:
    """Owns identity reading, deployment choice, API-session admission, the session tree and
    the deployments' modes."""

    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        *,
        tree: SessionTree | None = None,
        store: SessionStore | None = None,
        effects: EndActionSink | None = None,
        state: SessionState | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.identity = IdentityReader(config.identity, config.sessions.max_id_bytes)
        s = config.sessions
        self.deployments = [
            Deployment.from_config(
                d,
                selector_header=config.deployment_header,
                identity_headers=self.identity.header_names,
                max_overrides=s.max_live_sessions,
            )
            for d in config.resolved_deployments()
        ]
        for d in self.deployments:
            d.stats = metrics.for_deployment(d.name, d.mode_name)
        self._by_name = {d.name: d for d in self.deployments}
        self.default = self._by_name[config.default_deployment or self.deployments[0].name]
        self._selector = config.deployment_header.lower()
        self._primary_session_header = config.identity.session[0] if config.identity.session else ""
        # model -> deployment; consulted only when at least two deployments list models
        self._by_model = {m: d for d in self.deployments for m in sorted(d.models)}
        self._route_by_model = sum(1 for d in self.deployments if d.models) > 1
        # Bodies read before their deployment is known are held to the largest limits.
        self._selection_body_limit = max(d.limits.max_parsed_body_bytes for d in self.deployments)
        self._scan_depth = max(d.limits.max_json_depth for d in self.deployments)
        # The top-level keys the body scan locates: the model, the identity signals' keys, and
        # (added as modes use them) the first keys of body patches.
        names = ([b"model"] if self._route_by_model else []) + list(self.identity.body_keys)
        self._top_names = tuple(dict.fromkeys(names))
        self._patch_roots: set[str] = set()
        self._patching = frozenset(
            d.name for d in self.deployments if d.mode is not None and type(d.mode).body_patch is not Mode.body_patch
        )
        self._single = len(self.deployments) == 1
        self._body_identity = self.identity.reads_body
        self._worker_headers = tuple(n.lower() for n in config.affinity.worker_headers)
        self._workers: dict[str, str] = {}  # interned worker ids (a small set), bounded
        self.tree = tree or SessionTree(
            idle_ttl=s.idle_ttl_seconds,
            max_live=s.max_live_sessions,
            tombstone_max=s.tombstone_max,
            tombstone_ttl=s.tombstone_ttl_seconds,
            shared=state is not None and state.shared,
        )
        self.store = store or SessionStore(s.api)
        self._api_sessions = self.store.records  # the hot path reads it without a call
        self.effects = effects
        # Where sessions live beyond this process (sidecar.state): with a shared store, the tree
        # and the API table are this replica's cache of it, and the router reports turns to it.
        self.state = state or MemoryState()
        self._shared = self.state.shared
        metrics.watch_tree(self.tree)
        metrics.watch_deployments(self.deployments, self.store)

    # -- request path -------------------------------------------------------------------------

    def route(self, head: RequestHead, loaded: bool = False) -> Decision:
        """Decide how to forward a request. Raises :class:`errors.ProxyError` to answer it
        directly, and with a shared store :class:`~sidecar.state.LoadNeeded` when the request's
        session is not held here: the engine awaits ``state.load`` and calls again with
        ``loaded=True``."""
        # Flattened: this runs once per request. Hot-path decisions are built positionally (a
        # class called with keywords costs a dict per call); the request id is read once.
        headers = head.headers
        request_id = lookup(headers, _REQUEST_ID)
        ident = self.identity.read(headers)
        session = ident.session
        if self._shared and not loaded and self._not_held(session):
            raise LoadNeeded(ident)
        selector = lookup(headers, self._selector)
        selected = None if selector is None else self._selected(selector)
        body_identity = session is None and self._body_identity
        if session is None and selected is None and not self._route_by_model and not body_identity:
            dep = self.default  # the common sessionless case, kept cheap
            if dep.strict:
                raise _session_required(dep)
            return _sessionless(dep, request_id)
        if body_identity and _declares_body(head):
            # The session is named by the body (configured body signals): admission waits for it
            # (and the session's binding may name any deployment).
            dep = selected or self.default
            limit = self._selection_body_limit if selected is None else dep.max_parsed_body_bytes
            return _awaiting_body(dep, limit, _Pending(ident, headers, selected, selected), request_id)
        rec = self._api_sessions.get(session) if session is not None and self._api_sessions else None
        # One deployment: binding, selector and model can only name it (an unknown name was refused).
        decided = self.default if self._single else self._choose(session, rec, selected, None)
        if decided is None and self._route_by_model and _declares_body(head):
            return _awaiting_body(
                self.default, self._selection_body_limit, _Pending(ident, headers, selected, None), request_id
            )
        dep = decided or self.default
        if rec is not None or dep.strict:
            self._check_session(dep, session, rec)  # refuse early, before any body is read
        if dep.rewrites_body and session is not None and _declares_body(head):
            return _awaiting_body(
                dep, dep.max_parsed_body_bytes, _Pending(ident, headers, selected, decided), request_id
            )
        return self._admit(dep, ident, headers, rec, request_id)

    def transform_body(self, decision: Decision, body: bytes | list[bytes], size: int) -> Decision | BodyWork:
        """Second phase of a ``needs_body`` decision: scan the body (``size`` bytes, as one
        ``bytes`` or the chunks it arrived in), choose the deployment by its model when still
        open, admit the request, and return the complete decision, whose ``body`` is the body to
        forward (spliced or rewritten by a body mode; otherwise the body as received), or
        :class:`BodyWork` for a body larger than :data:`~sidecar.jsonscan.INLINE_BYTES`. Raises
        :class:`errors.ProxyError` to answer directly. Call it once per provisional decision."""
        pending = decision._held
        assert type(pending) is _Pending, "transform_body called for a decision that needs no body"
        decision._held = None
        if size > INLINE_BYTES:
            return BodyWork(partial(self._read_body, pending, body), partial(self._admit_body, decision, pending))
        return self._admit_body(decision, pending, self._read_body(pending, body))

    def _read_body(self, pending: _Pending, body: bytes | list[bytes]) -> _Read:
        """Join and scan the body and read what routing needs from it (pure: runs on a worker
        thread for large bodies)."""
        if not isinstance(body, bytes):
            body = join(body)
        scanned = scan_body(body, self._scan_depth, self._top_names)
        ident = pending.ident
        model_dep = None
        if scanned.is_object:
            if self._route_by_model:
                model = scanned.string(b"model", MAX_MODEL_BYTES)
                model_dep = self._by_model.get(model) if model is not None else None
            if ident.session is None and self._body_identity:
                ident = self.identity.read_body(pending.headers, scanned)
        return scanned, ident, model_dep

    def _chained(
        self, decision: Decision, pending: _Pending, read: _Read, model_dep: Deployment | None, loaded: bool
    ) -> tuple[Identity, bool]:
        """The identity of a Responses request chained by ``previous_response_id`` (its
        ``response``): the session that produced that response on the deployment the request
        goes to, else a new session (``chain-<32 hex>``), and whether that session is new. With
        a store that shares response ids, an id this replica does not know raises
        :class:`~sidecar.state.LoadNeeded` (``loaded``: the store was asked)."""
        ident = read[1]
        previous = ident.response
        known = self.state.response_session(previous) if previous else None
        if known is None and previous and self.state.shares_responses and not loaded:
            raise LoadNeeded(ident, partial(self._admit_body, decision, pending, read, True))
        if self._single:
            dep = self.default
        else:
            dep = self._choose(None, None, pending.selected, model_dep) or self.default
        fresh = known is None or known[0] != dep.name
        session = CHAIN_PREFIX + os.urandom(16).hex() if fresh else known[1]  # type: ignore[index]
        return Identity(session, ident.parent, ident.root, ident.final, previous), fresh

    def _not_held(self, session: str | None) -> bool:
        """With a shared store: ``session`` names a session this replica holds neither in its tree
        nor as an API session, so the store must be read first."""
        return session is not None and not self.tree.joinable(session) and session not in self._api_sessions

    def _admit_body(
        self, decision: Decision, pending: _Pending, read: _Read, loaded: bool = False
    ) -> Decision | BodyWork:
        """Admission of a request whose body was read (on the event loop), then its body mode.
        With a shared store, a session the body names that this replica does not hold raises
        :class:`~sidecar.state.LoadNeeded` whose ``resume`` continues here once loaded."""
        scanned, ident, model_dep = read
        if ident.response is not None:  # (a chained Responses request names no session itself)
            ident, fresh = self._chained(decision, pending, read, model_dep, loaded)
            loaded = loaded or fresh  # a new session's id is in no store
        session = ident.session
        if self._shared and not loaded and self._not_held(session):
            raise LoadNeeded(ident, partial(self._admit_body, decision, pending, read, True))
        body = scanned.data
        if scanned.status == TOO_DEEP:
            raise _too_deep(decision.deployment, self._scan_depth)
        if scanned.status == TOO_MANY:
            raise _repeated_keys(
                decision.deployment, "the request body repeats the top-level keys the sidecar reads too often"
            )
        # Re-resolved at admission: the session may have been bound or closed while the body
        # was read.
        rec = self._api_sessions.get(session) if session is not None else None
        if self._single:  # binding, selector and model can only name it (an unknown name was refused)
            dep = self.default
        else:
            dep = self._choose(session, rec, pending.selected, model_dep) or self.default
        if len(body) > dep.max_body_bytes:
            raise errors.request_too_large(dep.name, dep.max_body_bytes)
        if len(body) > dep.max_parsed_body_bytes:
            raise errors.request_too_large(dep.name, dep.max_parsed_body_bytes, True)
        if scanned.status > dep.max_json_depth:
            raise _too_deep(dep, dep.max_json_depth)
        self._check_session(dep, session, rec)
        admitted = self._admit(dep, ident, pending.headers, rec, decision.request_id)
        if ident.response is not None and admitted.ctx is not None:
            admitted.reads_response_id = True
        if admitted.ctx is None or not dep.rewrites_body:
            admitted.body = body
            return admitted
        try:
            result = self._rewrite(admitted, scanned)
        except BaseException:
            self.finish(admitted, TurnOutcome.UPSTREAM_FAILED)  # never handed out: released here
            raise
        return self._completed(admitted, result)

    def _completed(self, admitted: Decision, result: bytes | _Steps) -> Decision | BodyWork:
        """An admitted decision given one step of its body rewrite: its body, or body work to
        run off the loop. (The caller releases the admission when a step raises: the engine
        never held it.)"""
        if isinstance(result, bytes):
            admitted.body = result
            return admitted
        run, resume = result
        return BodyWork(run, partial(self._resume, admitted, resume), partial(self.finish, admitted))

    def _resume(self, admitted: Decision, resume: Callable[[Any], bytes], outcome: Any) -> Decision | BodyWork:
        try:
            result = resume(outcome)
        except BaseException:
            self.finish(admitted, TurnOutcome.UPSTREAM_FAILED)
            raise
        return self._completed(admitted, result)

    def _selected(self, name: str) -> Deployment:
        """The deployment the selector header names (raises for an unknown name)."""
        name = name.strip()
        dep = self._by_name.get(name)
        if dep is None:
            raise errors.ProxyError(
                errors.UNKNOWN_DEPLOYMENT,
                f"header {self.config.deployment_header} names no deployment: {name[:80]!r} "
                f"(deployments: {sorted(self._by_name)})",
                requested_deployment=name[:80],
            )
        return dep

    def binding(self, session: str, rec: ApiSession | None = None) -> Deployment | None:
        """The deployment ``session`` is bound to: its API session's (``rec``, looked up when not
        given), else its live lineage node's."""
        if rec is None:
            rec = self.store.get(session)
        name = rec.deployment if rec is not None else self.tree.bound_deployment(session)
        return None if name is None else self._by_name.get(name)

    def _choose(
        self, session: str | None, rec: ApiSession | None, selected: Deployment | None, model_dep: Deployment | None
    ) -> Deployment | None:
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
    def _conflict(
        session: str | None, bound: Deployment, requested: Deployment, by: str, how: str = "binding"
    ) -> errors.ProxyError:
        if session is not None and how == "binding":
            msg = (
                f"session {session!r} is bound to deployment {bound.name!r}; the request targets "
                f"deployment {requested.name!r} by {by}"
            )
        else:
            msg = f"the request targets deployment {bound.name!r} by header and deployment {requested.name!r} by {by}"
        return errors.ProxyError(
            errors.DEPLOYMENT_CONFLICT, msg, bound_deployment=bound.name, requested_deployment=requested.name
        )

    def _check_session(self, dep: Deployment, session: str | None, rec: ApiSession | None) -> None:
        """The admission rules of the API sessions and strict deployments (``rec``: the API
        session of ``session``, if any)."""
        if session is None:
            if dep.strict:
                raise _session_required(dep)
            return
        if rec is not None and rec.status is not SessionStatus.ACTIVE:
            expired = rec.status is SessionStatus.EXPIRED
            raise errors.ProxyError(
                errors.SESSION_EXPIRED if expired else errors.SESSION_CLOSED,
                f"session {session!r} is {rec.status.value}",
                deployment=rec.deployment,
            )
        if rec is None and dep.strict:
            raise errors.ProxyError(
                errors.SESSION_NOT_FOUND,
                f"deployment {dep.name!r} is strict: it only accepts sessions created "
                "through the sessions API, and this one is unknown",
                deployment=dep.name,
            )

    def _admit(
        self,
        dep: Deployment,
        ident: Identity,
        headers: Mapping[str, str],
        rec: ApiSession | None,
        request_id: str | None,
    ) -> Decision:
        """Admit a request to ``dep`` (after :meth:`_check_session`, in the same synchronous
        step): begin its turn, ask the mode."""
        session = ident.session
        if session is None:
            return _sessionless(dep, request_id)
        parent, root_hint = ident.parent, ident.root
        if rec is not None:
            self.store.begin(rec)
            if dep.strict or rec.parent is not None:
                parent, root_hint = rec.parent, None  # the API's lineage wins
        turn, evicted = self.tree.begin(
            session, parent=parent, root_hint=root_hint, final=ident.final, deployment=dep.name
        )
        if self._shared:
            self.state.begun(turn)
        if evicted:
            self._ended(evicted)
        ctx = turn.ctx
        upstream = dep.only_upstream or dep.pick_upstream(ctx.root)
        # The request id is set before mode hooks can fail (their error log carries it).
        decision = _admitted(dep, upstream, ctx, turn, rec, request_id)
        mode = dep.mode
        if mode is None:
            if dep.strict and self._primary_session_header:
                decision.add = ((self._primary_session_header, ctx.session),)  # the validated id
            return decision
        try:
            add = tuple(mode.request_headers(ctx))  # no copy when the mode returned a tuple
            if add:
                _check_added(add)
        except Exception as exc:
            self.finish(decision, TurnOutcome.UPSTREAM_FAILED)  # never handed out: released here
            raise self._mode_failed(decision, "request_headers", exc) from exc
        if add and dep.trust_client_headers:
            # A trusted client's own copy wins: keep it and add nothing under that name.
            add = _not_sent_by_client(add, headers)
        if add:
            decision.add = add
            dep.stats.headers_injected.inc()  # type: ignore[union-attr]
        return decision

    def _rewrite(self, decision: Decision, scanned: ScannedBody) -> bytes | _Steps:
        """The body-mode rewrite of an admitted request: a JSON object body gets the mode's
        patch spliced in (or goes through its ``transform_body``); any other body passes
        unchanged (or is refused, as the deployment says). A large body's rewrite is returned as
        ``(run, resume)``: ``run`` off the loop, ``resume(its outcome)`` back on it."""
        dep = decision.deployment
        mode = dep.mode
        ctx = decision.ctx
        assert mode is not None and ctx is not None
        body = scanned.data
        if not scanned.is_object:
            return self._not_object(decision, body, scanned.status == INVALID)
        if dep.name not in self._patching:
            if len(body) > INLINE_BYTES:
                return partial(_attempt, _transform, mode, ctx, body), partial(self._transformed, decision, body)
            return self._transformed(decision, body, _attempt(_transform, mode, ctx, body))
        try:
            patch = mode.body_patch(ctx)
            fields = patch if type(patch) is BodyPatch else None  # compiled: its fields are struct reads
            if patch is not None and (
                fields is None or type(fields.path) is not tuple or not fields.path or type(fields.path[0]) is not str
            ):
                raise TypeError(
                    f"body_patch must return a BodyPatch with a non-empty tuple of keys, or None (got {patch!r:.200})"
                )
        except Exception as exc:
            raise self._mode_failed(decision, "body_patch", exc) from exc
        if fields is None:
            dep.stats.rewritten().inc()  # type: ignore[union-attr]
            return body
        path, values, owned = fields.path, fields.values, fields.owned
        if path[0] not in self._patch_roots:
            self._locate_root(path[0])
        if len(body) > INLINE_BYTES:
            return partial(_attempt, splice, scanned, path, values, owned), partial(self._spliced, decision)
        try:  # (_attempt, inline: no Python-level call on the usual, small-body path)
            outcome: tuple[Any, Exception | None] = splice(scanned, path, values, owned), None
        except Exception as exc:
            outcome = None, exc
        return self._spliced(decision, outcome)

    def _spliced(self, decision: Decision, outcome: tuple[Any, Exception | None]) -> bytes:
        new, exc = outcome
        if exc is not None:
            raise self._body_failed(decision, "body_patch", exc) from exc
        decision.deployment.stats.rewritten().inc()  # type: ignore[union-attr]
        return new

    def _transformed(self, decision: Decision, body: bytes, outcome: tuple[Any, Exception | None]) -> bytes:
        new, exc = outcome
        if exc is not None:
            raise self._body_failed(decision, "transform_body", exc) from exc
        if new is None:  # valid JSON that orjson refuses to parse (1e400, an unpaired surrogate escape)
            return self._not_object(decision, body, True)
        decision.deployment.stats.rewritten().inc()  # type: ignore[union-attr]
        return new

    def _body_failed(self, decision: Decision, hook: str, exc: Exception) -> errors.ProxyError:
        """The error that answers a failed body rewrite: the client's body, or the mode."""
        if isinstance(exc, RepeatedKeys):
            return _repeated_keys(decision.deployment, str(exc))
        return self._mode_failed(decision, hook, exc)

    def _not_object(self, decision: Decision, body: bytes, invalid: bool) -> bytes:
        """A body mode's request whose body is not a JSON object: passed unchanged and counted,
        or refused when the deployment says so."""
        dep = decision.deployment
        counter = self.metrics.body_rewrites
        if dep.reject_non_object_body:
            counter.labels(dep.mode_name, "rejected").inc()
            self.metrics.rejected.labels("non_object_body").inc()
            raise errors.ProxyError(
                errors.INVALID_JSON_BODY,
                f"deployment {dep.name!r} (mode {dep.mode_name}) needs a JSON object request body",
                deployment=dep.name,
            )
        counter.labels(dep.mode_name, "passthrough_invalid_json" if invalid else "passthrough_not_object").inc()
        return body

    def _locate_root(self, key: str) -> None:
        """Have later body scans locate ``key`` (the first key of a mode's patches) too, so the
        splice needs no second pass over the body (a handful of keys: one or two per mode)."""
        self._patch_roots.add(key)
        name = key.encode()
        if name not in self._top_names and len(self._top_names) < MAX_SCAN_NAMES:
            self._top_names = (*self._top_names, name)

    def on_response(self, decision: Decision, status: int, headers: Mapping[str, str]) -> None:
        """The upstream's response head for ``decision`` arrived (``headers``: lower-case name
        lookup). Records which worker served the turn and lets the mode observe the response."""
        decision.status = status
        held = decision._held
        if type(held) is not _Admission:
            return
        turn = held.turn
        dep = decision.deployment
        if dep.observes_responses:
            assert dep.mode is not None and decision.ctx is not None
            try:
                state = dep.mode.on_response(decision.ctx, headers)
            except Exception as exc:  # the response is already on its way: count, never fail it
                self.metrics.plugin_errors.labels(dep.mode_name, "on_response").inc()
                log.error(
                    "mode %s failed in on_response: %r",
                    dep.mode_name,
                    exc,
                    extra={**decision.log_fields(), "hook": "on_response"},
                )
                state = None
            if state is not None:
                self.tree.set_mode_state(turn, state)
                if self._shared:
                    self.state.touched(turn, mode_state=True)
        for name in self._worker_headers:
            worker = lookup(headers, name)
            if worker:
                self._record_worker(decision, turn, worker.strip())
                return

    def reads_response(self, decision: Decision, status: int, headers: Mapping[str, str]) -> bool:
        """Whether the engine must hand the first bytes of this response's body to
        :meth:`response_start`: a request chained by ``previous_response_id`` answered 200 with
        a body that is not content-encoded (``headers``: lower-case name lookup)."""
        return decision.reads_response_id and status == 200 and not lookup(headers, _CONTENT_ENCODING)

    def response_start(self, decision: Decision, data: bytes, chunked: bool) -> bool:
        """One read of the beginning of a response body :meth:`reads_response` asked for
        (``chunked``: with its chunked framing), in order; True once no more is needed. When the
        body names the response's id, which session produced it is remembered."""
        reader = decision.first_bytes
        if reader is None:
            reader = decision.first_bytes = FirstBytes(chunked)
        done, response_id = reader.feed(data)
        if not done:
            return False
        decision.first_bytes = None
        decision.reads_response_id = False
        ctx = decision.ctx
        if response_id is not None and ctx is not None:
            self.state.remember_response(response_id, decision.deployment.name, ctx.session)
        return True

    def _record_worker(self, decision: Decision, turn: Turn, worker: str) -> None:
        worker = fit_id(worker, MAX_WORKER_BYTES)
        interned = self._workers.get(worker)
        if interned is None:
            interned = worker
            if len(self._workers) < MAX_INTERNED_WORKERS:
                self._workers[worker] = worker
        outcome, previous = self.tree.record_worker(turn, interned)
        if self._shared:
            self.state.touched(turn)
        self.metrics.affinity_turn(decision.deployment.name, outcome).inc()
        if outcome == "moved":
            extra: dict[str, Any] = {
                "event": "moved",
                **decision.log_fields(),
                "from_worker": previous,
                "to_worker": interned,
                "turn": turn.ctx.turn,
            }
            if _debug_on():  # session ids only at debug level
                extra["session"] = turn.ctx.session
            log.info("session moved to another worker", extra=extra)

    def upstream_unreachable(self, decision: Decision) -> None:
        """The engine could not connect to ``decision.upstream`` (nothing was sent): mark it
        unhealthy so the tree's next request fails over (see :mod:`sidecar.balancer`)."""
        decision.deployment.balancer.mark_unreachable(decision.upstream)

    def _mode_failed(self, decision: Decision, hook: str, exc: Exception) -> errors.ProxyError:
        """Count and log a mode hook's failure; the error that answers the request."""
        dep = decision.deployment
        self.metrics.plugin_errors.labels(dep.mode_name, hook).inc()
        log.error("mode %s failed in %s: %r", dep.mode_name, hook, exc, extra={**decision.log_fields(), "hook": hook})
        return errors.ProxyError(
            errors.MODE_ERROR,
            f"routing mode {dep.mode_name!r} failed in {hook}: {exc}",
            mode=dep.mode_name,
            deployment=dep.name,
        )

    def finish(self, decision: Decision, outcome: TurnOutcome) -> None:
        """The request is over (last byte written, failed, or abandoned): release its turn and
        its API session. Engines call it exactly once per decision they hold."""
        held = decision._held
        decision._held = None
        if _debug_on():  # the access log: debug level (it names sessions)
            ctx = decision.ctx
            log.debug(
                "request finished",
                extra={
                    "event": "request",
                    **decision.log_fields(),
                    "status": decision.status,
                    "outcome": str(outcome),
                    "session": ctx.session if ctx else None,
                    "turn": ctx.turn if ctx else None,
                },
            )
        if type(held) is _Admission:
            self._release(held, outcome)

    def _release(self, held: _Admission, outcome: TurnOutcome) -> None:
        """Release what an admitted request held: its turn, and its API session if any."""
        if held.api_session is not None:
            self.store.finish(held.api_session)
        turn = held.turn
        ended = self.tree.finish(turn, outcome)
        if self._shared:
            self.state.finished(turn)
        if ended:
            self._ended(ended)

    # -- session lifecycle ------------------------------------------------------------------

    def expire(self, limit: int = EXPIRE_BATCH) -> bool:
        """Idle sweep of the tree and of API sessions, at most ``limit`` sessions each; the app
        calls this periodically, and again at once while it returns True (work left). With a
        shared store this only forgets idle sessions here: the store expires them fleet-wide."""
        ended, more = self.tree.expire(limit)
        for rec in self.store.expire(end_active=not self._shared):
            ended += self.tree.close(rec.id, EndReason.IDLE_EXPIRED)
        if ended:
            self._ended(ended)
        return more

    def shutdown(self) -> None:
        """End every live session (after the drain)."""
        ended = self.tree.shutdown()
        if ended:
            self._ended(ended)

    def close_session(self, session: str, reason: EndReason = EndReason.API_CLOSED) -> None:
        """End ``session`` in the lineage tree (API close); in-flight requests finish first."""
        ended = self.tree.close(session, reason)
        if ended:
            self._ended(ended)

    def closing_elsewhere(self, session: str, reason: str) -> None:
        """Another replica started closing ``session`` (a shared store's event): admit none of
        its requests from now on; the ones in flight here finish, then its end is claimed."""
        rec = self.store.get(session)
        if rec is not None and rec.status is SessionStatus.ACTIVE:
            self.store.mark_ended(session, SessionStatus.CLOSED, time.time())
        try:
            why = EndReason(reason)
        except ValueError:
            why = EndReason.API_CLOSED
        self.close_session(session, why)

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

    def _ended(self, ended: Sequence[SessionEnd]) -> None:
        """Sessions that ended in the tree: their end-of-session actions run now, or, with a
        shared store, once the store let this replica claim them (:meth:`end_session`)."""
        for e in self.state.local_ends(ended):
            self.end_session(e)

    def end_session(self, e: SessionEnd, ran: Callable[[], None] | None = None) -> None:
        """The end of one session, exactly once: count it, run the mode's end-of-session hook
        and hand its actions to the effects runner, forget the tree's upstream override.
        ``ran`` is called once every end action ran or was given up (at once when there are
        none): a shared store confirms its claim of the end then."""
        dep = self.deployment(e.deployment)
        # The label only takes configured names (a closed set).
        self.metrics.sessions_ended.labels(dep.name if dep is not None else "unknown", str(e.reason)).inc()
        self._end_actions(e, dep, ran)
        if dep is not None and dep.balancer.overrides and self.tree.get(e.root) is None:
            dep.balancer.forget(e.root)  # the tree is gone

    def _end_actions(self, e: SessionEnd, dep: Deployment | None, ran: Callable[[], None] | None) -> None:
        if dep is None or dep.mode is None:
            if ran is not None:
                ran()
            return
        try:
            actions = tuple(dep.mode.on_session_end(e))
        except Exception as exc:  # a broken hook never stops cleanup of other sessions
            self.metrics.plugin_errors.labels(dep.mode_name, "on_session_end").inc()
            log.error(
                "mode %s failed in on_session_end: %r",
                dep.mode_name,
                exc,
                extra={"deployment": dep.name, "mode": dep.mode_name, "hook": "on_session_end"},
            )
            actions = ()
        if not actions or self.effects is None:
            if ran is not None:
                ran()
            return
        each = None if ran is None else _AllRan(len(actions), ran)
        for action in actions:
            self.effects(dep, action, e.root, each)


class _AllRan:
    """Calls ``ran`` when it was itself called ``n`` times: once per end action of a session."""

    __slots__ = ("n", "ran")

    def __init__(self, n: int, ran: Callable[[], None]) -> None:
        self.n = n
        self.ran = ran

    def __call__(self) -> None:
        self.n -= 1
        if self.n == 0:
            self.ran()


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
        if type(value) is not str or not is_field_value(value):
            raise ValueError(f"the value of header {name!r} is not a valid field value")


def _attempt(fn: Callable[..., Any], *args: Any) -> tuple[Any, Exception | None]:
    """``(fn(*args), None)``, or ``(None, the exception)``: body work's outcome, handed from a
    worker thread to the event loop, where failures are attributed."""
    try:
        return fn(*args), None
    except Exception as exc:
        return None, exc


def _transform(mode: Mode, ctx: RoutingContext, body: bytes) -> bytes | None:
    """A ``transform_body`` mode's rewrite: parse, transform, serialize (None: orjson refuses
    to parse the body)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return orjson.dumps(mode.transform_body(ctx, obj))


def _too_deep(dep: Deployment, limit: int) -> errors.ProxyError:
    return errors.ProxyError(
        errors.JSON_TOO_DEEP,
        f"request body nests JSON deeper than {limit} levels (limits.max_json_depth of deployment {dep.name!r})",
        deployment=dep.name,
        limit=limit,
    )


def _repeated_keys(dep: Deployment, message: str) -> errors.ProxyError:
    return errors.ProxyError(errors.INVALID_JSON_BODY, f"{message} (deployment {dep.name!r})", deployment=dep.name)


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
    return errors.ProxyError(
        errors.SESSION_REQUIRED,
        f"deployment {dep.name!r} is strict: requests must name a session created through the sessions API",
        deployment=dep.name,
    )


_CONTENT_LENGTH = h.CONTENT_LENGTH.lower()
_CONTENT_ENCODING = h.CONTENT_ENCODING.lower()
_REQUEST_ID = h.X_REQUEST_ID.lower()
_TRANSFER_ENCODING = h.TRANSFER_ENCODING.lower()
# Header names modes asked to add, checked once each (_check_added); bounded.
_ADDABLE: dict[str, bool] = {}
MAX_ADDABLE = 256
