"""The routing decision: identity -> deployment -> session admission -> lineage -> mode.

Per request an engine calls :meth:`Router.admit` with the request head and gets an
:class:`Admission`: one object that says what the request needs next (``need``) and takes what
the engine brings back, until it is decided (READY: forward its :class:`Decision`) or refused
(REFUSED: answer its error). Between the two, with a shared store, it may need a session loaded
(LOAD), the whole body (BODY: to pick a deployment by model, to read body identity signals, or
because the deployment's mode rewrites bodies) and body work on a worker thread (WORK: a body
larger than :data:`~sidecar.jsonscan.INLINE_BYTES` is scanned and spliced off the event loop).
The engine then reports the response (``on_response``, ``upstream_unreachable``; for a session's
response, what its body said of its prompt-cache usage: ``usage_reader``, ``on_usage``) and ends
it with ``finish(outcome)``, which releases the turn once however often it is called. The states
are drawn in docs/architecture.md. Everything here is synchronous: no I/O, no awaits, so the
lineage tree and the API session store need no locks, and a sessions-API close is ordered with
every admission.

A request's deployment is, in order: its session's binding (an API session's deployment, or the
deployment of the live session's first request), the selector header (``deployment_header``),
the body's ``model`` (only when at least two deployments list models, the head declares a body,
and nothing before decided), the default. A selector or model naming another deployment than
the binding answers 409 ``deployment_conflict``. Admission then applies the session rules
(closed/expired API sessions: 410; strict deployments: API sessions only) and begins the turn.

Bodies are read as the client's bytes (:mod:`sidecar.jsonbody`): one strict scan, bounded in size
(``limits.max_parsed_body_bytes``) and depth (``limits.max_json_depth``), locates the top-level
members routing reads; a body mode's patch is spliced into those bytes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from logging import DEBUG
from typing import Any

import orjson

from sidecar import errors
from sidecar import headers as h
from sidecar.accounting import Accounting, with_include_usage
from sidecar.config import Config
from sidecar.context import BodyPatch, EndReason, RoutingContext, SessionEnd, TurnOutcome
from sidecar.deployments import Deployment, Upstream
from sidecar.headers import is_field_value, lookup
from sidecar.identity import Identity, IdentityReader
from sidecar.jsonbody import INVALID, TOO_DEEP, TOO_MANY, RepeatedKeys, ScannedBody, scan_body, splice
from sidecar.jsonscan import INLINE_BYTES, join
from sidecar.lineage import SessionTree, Turn
from sidecar.metrics import Metrics
from sidecar.modes.base import Mode
from sidecar.modes.ids import fit_id
from sidecar.responses import FirstBytes
from sidecar.sessions import ApiSession, SessionStatus, SessionStore
from sidecar.state import SessionState
from sidecar.usage import UNREADABLE, Usage, UsageReader
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


# Sessions one idle sweep ends at most before it yields the event loop (a few ms of work).
EXPIRE_BATCH = 1000
# Worker ids are interned so every session's history shares one string per worker.
MAX_INTERNED_WORKERS = 4096
# A worker id longer than this (UTF-8 bytes) is kept and logged in its fitted form (a prefix and
# a digest): it comes from an upstream's header, and the tree keeps it per session.
MAX_WORKER_BYTES = 256
# Threads an engine runs an admission's body work on (see body_pool): large bodies only, a few at a time.
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
    target: bytes = b""  # the request target as received (path and query)


@dataclass
class Decision:
    """How to forward one request: to ``upstream`` of ``deployment``, with the client's headers
    minus ``drop`` (lower-case names), then ``add``; ``body``: the body to forward when the
    router read it (then with a fresh Content-Length; None: the client's body streams, at most
    ``max_body_bytes``). Built once by the router (:func:`_decision`), never changed after an
    admission handed it out (compiled: read-only fields)."""

    deployment: Deployment
    upstream: Upstream
    drop: frozenset[str]
    add: tuple[tuple[str, str], ...]
    ctx: RoutingContext | None
    max_body_bytes: int
    body: bytes | None = None


# What the scan of a request's body found: the scan, the identity, the model's deployment.
_Read = tuple[ScannedBody, Identity, "Deployment | None"]
# What an admission needs next (Admission.need): the states of docs/architecture.md.
READY = 0  # decided: forward ``decision``
LOAD = 1  # await ``router.state.load(identity)``, then call ``loaded()``
BODY = 2  # read the whole body (at most ``limit`` bytes, else 413), then call ``body(data, size)``
WORK = 3  # run ``work()`` on the body pool (:func:`body_pool`), then call ``worked(what it returned)``
REFUSED = 4  # answer ``error``, counted as rejected for ``reason`` (None: a defect, a 500)
# Which body step runs as WORK: the scan, the mode's patch spliced in, its transform_body, the
# request for usage (usage.include_usage). _USAGE is also the body step of a request admitted at
# its head whose body is read only to ask for usage (BODY).
_SCAN, _SPLICE, _TRANSFORM, _USAGE = range(4)


@dataclass
class Admission:
    """One request's way through the router, made by :meth:`Router.admit` (module docstring).

    The engine does what ``need`` says and feeds the outcome back (``loaded``, ``body``,
    ``worked``: each only while it is what the admission needs), until ``need`` is READY or
    REFUSED; then ``on_response``, ``reads_response`` / ``response_start`` and
    ``upstream_unreachable`` as the response goes, and ``finish(outcome)`` once the request is
    over, whatever its need: the first call releases what the request holds, later ones and any
    later feed change nothing (a client that left while the admission waited). A refusal
    finishes it itself."""

    router: Router
    head: RequestHead
    # Labels errors and metrics: the default deployment until the head names one, the one whose
    # limits apply while the body is read (BODY), the decision's (READY).
    deployment: Deployment
    request_id: str | None  # the client's X-Request-ID, for log lines
    # The defaults: what a compiled __new__ leaves (None, 0, False; limit is set by admit).
    need: int = READY
    limit: int = 0  # the body bytes allowed: to read (BODY), to stream (READY)
    decision: Decision | None = None  # READY (while WORK: the admitted one its body waits for)
    error: errors.ProxyError | None = None  # REFUSED
    reason: str | None = None  # REFUSED
    identity: Identity | None = None  # what the head declares; LOAD: the session to load
    work: Callable[[], Any] | None = None  # WORK: runs on a worker thread, only reads its arguments
    selected: Deployment | None = None  # named by the selector header
    status: int = 0  # the upstream's response status once its head arrived
    # What finish releases: the turn begun in the lineage tree and the API session it counts in.
    turn: Turn | None = None
    api_session: ApiSession | None = None
    finished: bool = False
    # Chained by previous_response_id: the response body's first bytes go to response_start.
    reads_response_id: bool = False
    first_bytes: FirstBytes | None = None  # what response_start gathered of them so far
    read: _Read | None = None  # the body's scan, identity and model deployment, once read
    step: int = _SCAN  # which body step ``work`` is (_SCAN, _SPLICE, _TRANSFORM, _USAGE)

    # -- what the engine brings back ------------------------------------------------------------

    def loaded(self) -> None:
        """The session LOAD named was loaded from the shared store (or the store gave up)."""
        self.router._feed(self, LOAD, None, 0)

    def body(self, data: bytes | list[bytes], size: int) -> None:
        """The whole body (BODY): ``size`` bytes, as one ``bytes`` or the chunks it arrived in
        (a large body is joined off the loop)."""
        self.router._feed(self, BODY, data, size)

    def worked(self, result: Any) -> None:
        """What ``work()`` returned (WORK); None when it did not run (the engine is closing)."""
        self.router._feed(self, WORK, result, 0)

    def too_large(self) -> errors.ProxyError:
        """The 413 that answers a body above ``limit``: the limit of the bodies the sidecar reads
        as JSON while it needs the body to decide (BODY), else the deployment's body limit."""
        return errors.request_too_large(self.deployment.name, self.limit, self.need == BODY and self.step != _USAGE)

    # -- the response ---------------------------------------------------------------------------

    def on_response(self, status: int, headers: Mapping[str, str]) -> None:
        """The upstream's response head arrived (``headers``: lower-case name lookup): records
        which worker served the turn and lets the mode observe the response."""
        self.status = status
        turn = self.turn
        if turn is None:
            return
        router = self.router
        assert self.decision is not None
        dep = self.decision.deployment
        if dep.observes_responses:
            assert dep.mode is not None and self.decision.ctx is not None
            try:
                state = dep.mode.on_response(self.decision.ctx, headers)
            except Exception as exc:  # the response is already on its way: count, never fail it
                router.metrics.plugin_errors.labels(dep.mode_name, "on_response").inc()
                log.error(
                    "mode %s failed in on_response: %r",
                    dep.mode_name,
                    exc,
                    extra={**self.log_fields(), "hook": "on_response"},
                )
                state = None
            if state is not None:
                router.tree.set_mode_state(turn, state)
                if router._shared:
                    router.state.touched(turn, mode_state=True)
        for name in router._worker_headers:
            worker = lookup(headers, name)
            if worker:
                router._record_worker(self, turn, worker.strip())
                return

    def reads_response(self, status: int, headers: Mapping[str, str]) -> bool:
        """Whether the engine must hand the first bytes of this response's body to
        :meth:`response_start`: a request chained by ``previous_response_id`` answered 200 with
        a body that is not content-encoded (``headers``: lower-case name lookup)."""
        return self.reads_response_id and status == 200 and not lookup(headers, _CONTENT_ENCODING)

    def response_start(self, data: bytes, chunked: bool) -> bool:
        """One read of the beginning of a response body :meth:`reads_response` asked for
        (``chunked``: with its chunked framing), in order; True once no more is needed. When the
        body names the response's id, which session produced it is remembered."""
        reader = self.first_bytes
        if reader is None:
            reader = self.first_bytes = FirstBytes(chunked)
        done, response_id = reader.feed(data)
        if not done:
            return False
        self.first_bytes = None
        self.reads_response_id = False
        decision = self.decision
        if response_id is not None and decision is not None and decision.ctx is not None:
            self.router.state.remember_response(response_id, decision.deployment.name, decision.ctx.session)
        return True

    def usage_reader(self, status: int, headers: Mapping[str, str], chunked: bool) -> UsageReader | None:
        """A reader of the prompt-cache usage of this response (``headers``: lower-case name
        lookup; ``chunked``: the body's bytes the engine will show it carry chunked framing), or
        None when it is not accounted: no session, accounting off for the deployment, a status
        other than 200, a body that is neither JSON nor an event stream. A content-encoded body
        is counted unreadable here (None). Engines do not ask for a response without a body (to
        HEAD, 204, 304).

        With the reader, the engine shows :meth:`~sidecar.usage.UsageReader.first` the body's
        first reads until it returns True and :meth:`~sidecar.usage.UsageReader.last` its last
        bytes (bounded copies, as they came from the upstream), then, once the body was relayed
        completely, hands :meth:`~sidecar.usage.UsageReader.result` to :meth:`on_usage` before
        :meth:`finish`; a body that did not end (its client left, its upstream failed) only a
        result that reported counts (read from the last bytes before the cut)."""
        turn = self.turn
        decision = self.decision
        if turn is None or decision is None or status != 200:
            return None
        router = self.router
        dep = decision.deployment
        if not router.accounting.accounts(dep.name):
            return None
        kind = lookup(headers, _CONTENT_TYPE) or ""
        if kind != "application/json" and kind != "text/event-stream":  # (else: as most send them)
            kind = kind.partition(";")[0].strip().lower()
        stream = kind == "text/event-stream"
        if (
            not stream
            and kind != "application/json"
            and not (kind.startswith("application/") and kind.endswith("+json"))
        ):
            return None
        encoding = lookup(headers, _CONTENT_ENCODING)
        if encoding and encoding.strip().lower() != "identity":
            router._account(dep, turn, UNREADABLE)
            return None
        return UsageReader(chunked, stream)

    def on_usage(self, usage: Usage) -> None:
        """What the response said of its prompt-cache usage (its reader's ``result()``), once its
        body ended (or, cut, said its counts) and before :meth:`finish`: counted for its session (its
        tree's node, the shared store), its deployment and its turn. Nothing after finish."""
        turn = self.turn
        decision = self.decision
        if turn is not None and decision is not None:
            self.router._account(decision.deployment, turn, usage)

    def upstream_unreachable(self) -> None:
        """The engine could not connect to the decision's upstream (nothing was sent): mark it
        unhealthy so the tree's next request fails over (see :mod:`sidecar.balancer`)."""
        decision = self.decision
        assert decision is not None
        decision.deployment.balancer.mark_unreachable(decision.upstream)

    def finish(self, outcome: TurnOutcome) -> None:
        """The request is over (last byte written, failed, refused or abandoned): release its
        turn and its API session. Only the first call counts."""
        if self.finished:
            return
        self.finished = True
        turn = self.turn
        self.turn = None
        if _debug_on():  # the access log: debug level (it names sessions)
            ctx = self.decision.ctx if self.decision is not None else None
            log.debug(
                "request finished",
                extra={
                    "event": "request",
                    **self.log_fields(),
                    "status": self.status,
                    "outcome": str(outcome),
                    "session": ctx.session if ctx else None,
                    "turn": ctx.turn if ctx else None,
                },
            )
        if turn is not None:
            self.router._release(turn, self.api_session, outcome)

    def log_fields(self) -> dict[str, Any]:
        """What every log line about this request carries: request id and deployment."""
        dep = self.deployment
        return {"request_id": self.request_id, "deployment": dep.name, "mode": dep.mode_name}

    # -- the router's ---------------------------------------------------------------------------

    def _ready(self, decision: Decision) -> None:
        self.need = READY
        self.decision = decision
        self.deployment = decision.deployment
        self.limit = decision.max_body_bytes

    def _wait(self, need: int, deployment: Deployment | None, limit: int, work: Callable[[], Any] | None) -> None:
        """Need LOAD (``identity`` set), BODY (from ``deployment``, ``limit`` bytes) or WORK."""
        self.need = need
        if deployment is not None:
            self.deployment = deployment
            self.limit = limit
        self.work = work

    def _failed(self, exc: Exception) -> None:
        """A step raised: refuse with the router's error, or answer a defect with 500."""
        if isinstance(exc, errors.ProxyError):
            self._refuse(exc, exc.type)
            return
        log.error("request admission failed: %r", exc, exc_info=exc, extra=self.log_fields())
        self._refuse(errors.internal_error(), None)

    def _refuse(self, exc: errors.ProxyError, reason: str | None) -> None:
        self.need = REFUSED
        self.error = exc
        self.reason = reason
        self.finish(_UPSTREAM_FAILED)


# Built field by field: compiled, an allocation and stores (calling a class packs its arguments
# into a tuple and parses them), and these run once per request.


def _decision(dep: Deployment, upstream: Upstream, drop: frozenset[str], ctx: RoutingContext | None) -> Decision:
    decision = Decision.__new__(Decision)
    decision.deployment = dep
    decision.upstream = upstream
    decision.drop = drop
    decision.add = ()
    decision.ctx = ctx
    decision.max_body_bytes = dep.max_body_bytes
    decision.body = None
    return decision


def _sessionless(dep: Deployment) -> Decision:
    """A request of no session: forwarded as is (minus the deployment's sessionless drops)."""
    return _decision(dep, dep.pick_upstream(None), dep.drop_sessionless, None)


def body_pool() -> ThreadPoolExecutor:
    """The bounded thread pool an engine runs an admission's ``work`` on (one per engine; shut
    it down when the engine closes)."""
    return ThreadPoolExecutor(BODY_THREADS, thread_name_prefix="sidecar-body")


class Router:
    """Owns identity reading, deployment choice, API-session admission, the session tree and
    the deployments' modes."""

    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        *,
        identity: IdentityReader,
        deployments: list[Deployment],
        tree: SessionTree,
        store: SessionStore,
        state: SessionState,
    ) -> None:
        """Built once, from parts built before it (:func:`sidecar.wiring.routing_core`)."""
        self.config = config
        self.metrics = metrics
        self.identity = identity
        self.deployments = deployments
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
        self.tree = tree
        self.store = store
        self._api_sessions = self.store.records  # the hot path reads it without a call
        # Where sessions live beyond this process (sidecar.state): with a shared store, the tree
        # and the API table are this replica's cache of it, and the router reports turns to it;
        # sessions that end go to it (it runs them, or claims them first).
        self.state = state
        self._shared = self.state.shared
        # Prompt-cache accounting: counters, the live view's aggregates, each deployment's settings.
        self.accounting = Accounting(config, metrics)
        # Whether any deployment asks streamed chat completions for their usage (usage.include_usage).
        self._injecting = any(self.accounting.injects(d.name) for d in self.deployments)
        metrics.watch_tree(self.tree)
        metrics.watch_deployments(self.deployments, self.store)

    # -- request path -------------------------------------------------------------------------

    def admit(self, head: RequestHead) -> Admission:
        """Begin the admission of a request (module docstring): decided, refused, or waiting for
        what its ``need`` says."""
        adm = Admission.__new__(Admission)  # field by field (see _decision); the others: their defaults
        adm.router = self
        adm.head = head
        adm.deployment = self.default
        adm.request_id = lookup(head.headers, _REQUEST_ID)
        adm.limit = 0  # (a Python int: compiled, None until set)
        try:
            self._route(adm, False)
        except errors.ProxyError as exc:
            adm._refuse(exc, exc.type)
        return adm

    def _feed(self, adm: Admission, need: int, data: Any, size: int) -> None:
        """What ``adm`` needed (``need``) came: take the next step, or refuse."""
        if adm.finished:
            return  # (the client left while the admission waited: nothing more to do)
        if adm.need != need:
            raise RuntimeError(f"admission fed {need} while it needs {adm.need}")
        try:
            if need == BODY:
                self._body(adm, data, size)
            elif need == WORK:
                self._worked(adm, data)
            elif adm.read is None:
                self._route(adm, True)
            else:
                self._admit_body(adm, True)
        except Exception as exc:
            adm._failed(exc)

    def _route(self, adm: Admission, loaded: bool) -> None:
        """What the head decides (``loaded``: the shared store was asked for its session)."""
        # Flattened: this runs once per request.
        head = adm.head
        headers = head.headers
        ident = self.identity.read(headers)
        session = ident.session
        adm.identity = ident
        if self._shared and not loaded and self._not_held(session):
            adm._wait(LOAD, None, 0, None)
            return
        selector = lookup(headers, self._selector)
        selected = None if selector is None else self._selected(selector)
        body_identity = session is None and self._body_identity
        if session is None and selected is None and not self._route_by_model and not body_identity:
            dep = self.default  # the common sessionless case, kept cheap
            if dep.strict:
                raise _session_required(dep)
            adm._ready(_sessionless(dep))
            return
        adm.selected = selected
        if body_identity and _declares_body(head):
            # The session is named by the body (configured body signals): admission waits for it
            # (and the session's binding may name any deployment).
            dep = selected or self.default
            adm._wait(BODY, dep, self._selection_body_limit if selected is None else dep.max_parsed_body_bytes, None)
            return
        rec = self._api_sessions.get(session) if session is not None and self._api_sessions else None
        # One deployment: binding, selector and model can only name it (an unknown name was refused).
        decided = self.default if self._single else self._choose(session, rec, selected, None)
        if decided is None and self._route_by_model and _declares_body(head):
            adm._wait(BODY, self.default, self._selection_body_limit, None)
            return
        dep = decided or self.default
        if rec is not None or dep.strict:
            self._check_session(dep, session, rec)  # refuse early, before any body is read
        if dep.rewrites_body and session is not None and _declares_body(head):
            adm._wait(BODY, dep, dep.max_parsed_body_bytes, None)
            return
        decision = self._admit(adm, dep, ident, rec)
        if self._injecting and decision.ctx is not None and self._asks_usage(dep, head):
            # Admitted; its body is read to ask for usage (_USAGE), then it is READY.
            adm.decision = decision
            adm.step = _USAGE
            adm._wait(BODY, dep, dep.max_body_bytes, None)
            return
        adm._ready(decision)

    def _body(self, adm: Admission, data: bytes | list[bytes], size: int) -> None:
        """The body came: scanned here, or off the loop when large."""
        assert adm.identity is not None
        if adm.step == _USAGE:  # admitted at its head: only asked for usage
            decision = adm.decision
            assert decision is not None
            if size > INLINE_BYTES:
                self._off_loop(adm, decision, _USAGE, partial(_attempt, _include_usage, data, decision.deployment))
                return
            decision.body = _include_usage(data, decision.deployment)
            adm._ready(decision)
            return
        if size > INLINE_BYTES:
            adm.step = _SCAN
            adm._wait(WORK, None, 0, partial(_attempt, self._read_body, adm.identity, adm.head.headers, data))
            return
        adm.read = self._read_body(adm.identity, adm.head.headers, data)
        self._admit_body(adm, False)

    def _worked(self, adm: Admission, result: tuple[Any, Exception | None] | None) -> None:
        """Body work ran: the admission goes on with its outcome."""
        if result is None:
            raise RuntimeError("body work did not run (the engine is closing)")
        step = adm.step
        if step == _SCAN:
            read, exc = result
            if exc is not None:
                raise exc  # a defect: the scan reports the body's faults in its result
            adm.read = read
            self._admit_body(adm, False)
            return
        decision = adm.decision
        assert decision is not None
        if step == _USAGE:
            body, exc = result
            if exc is not None:
                raise exc  # a defect: the patch leaves a body it cannot read unchanged
            decision.body = body
            adm._ready(decision)
            return
        assert adm.read is not None
        if step == _SPLICE:
            body = self._spliced(adm, decision, result)
        else:
            body = self._transformed(adm, decision, adm.read[0].data, result)
        self._forward_body(adm, decision, body)

    def _read_body(self, ident: Identity, headers: Mapping[str, str], body: bytes | list[bytes]) -> _Read:
        """Join and scan the body and read what routing needs from it (pure: runs on a worker
        thread for large bodies)."""
        if not isinstance(body, bytes):
            body = join(body)
        scanned = scan_body(body, self._scan_depth, self._top_names)
        model_dep = None
        if scanned.is_object:
            if self._route_by_model:
                model = scanned.string(b"model", MAX_MODEL_BYTES)
                model_dep = self._by_model.get(model) if model is not None else None
            if ident.session is None and self._body_identity:
                ident = self.identity.read_body(headers, scanned)
        return scanned, ident, model_dep

    def _chained(
        self, adm: Admission, ident: Identity, model_dep: Deployment | None, loaded: bool
    ) -> tuple[Identity, bool] | None:
        """The identity of a Responses request chained by ``previous_response_id`` (its
        ``response``): the session that produced that response on the deployment the request
        goes to, else a new session (``chain-<32 hex>``), and whether that session is new. With
        a store that shares response ids, an id this replica does not know needs a LOAD first
        (None; ``loaded``: the store was asked)."""
        previous = ident.response
        known = self.state.response_session(previous) if previous else None
        if known is None and previous and self.state.shares_responses and not loaded:
            adm.identity = ident
            adm._wait(LOAD, None, 0, None)
            return None
        if self._single:
            dep = self.default
        else:
            dep = self._choose(None, None, adm.selected, model_dep) or self.default
        new_session = known is None or known[0] != dep.name
        session = CHAIN_PREFIX + os.urandom(16).hex() if new_session else known[1]  # type: ignore[index]
        return Identity(session, ident.parent, ident.root, ident.final, previous), new_session

    def _not_held(self, session: str | None) -> bool:
        """With a shared store: ``session`` names a session this replica holds neither in its tree
        nor as an API session, so the store must be read first."""
        return session is not None and not self.tree.joinable(session) and session not in self._api_sessions

    def _admit_body(self, adm: Admission, loaded: bool) -> None:
        """Admission of a request whose body was read, then its body mode. With a shared store,
        a session the body names that this replica does not hold needs a LOAD first."""
        assert adm.read is not None
        scanned, ident, model_dep = adm.read
        if ident.response is not None:  # (a chained Responses request names no session itself)
            chained = self._chained(adm, ident, model_dep, loaded)
            if chained is None:
                return
            ident, new_session = chained
            loaded = loaded or new_session  # a new session's id is in no store
        session = ident.session
        if self._shared and not loaded and self._not_held(session):
            adm.identity = ident
            adm._wait(LOAD, None, 0, None)
            return
        body = scanned.data
        if scanned.status == TOO_DEEP:
            raise _too_deep(adm.deployment, self._scan_depth)
        if scanned.status == TOO_MANY:
            raise _repeated_keys(
                adm.deployment, "the request body repeats the top-level keys the sidecar reads too often"
            )
        # Re-resolved at admission: the session may have been bound or closed while the body
        # was read.
        rec = self._api_sessions.get(session) if session is not None else None
        if self._single:  # binding, selector and model can only name it (an unknown name was refused)
            dep = self.default
        else:
            dep = self._choose(session, rec, adm.selected, model_dep) or self.default
        if len(body) > dep.max_body_bytes:
            raise errors.request_too_large(dep.name, dep.max_body_bytes)
        if len(body) > dep.max_parsed_body_bytes:
            raise errors.request_too_large(dep.name, dep.max_parsed_body_bytes, True)
        if scanned.status > dep.max_json_depth:
            raise _too_deep(dep, dep.max_json_depth)
        self._check_session(dep, session, rec)
        decision = self._admit(adm, dep, ident, rec)
        if ident.response is not None and decision.ctx is not None:
            adm.reads_response_id = True
        if decision.ctx is not None and dep.rewrites_body:
            rewritten = self._rewrite(adm, decision, scanned)  # (the admission releases the turn if it raises)
            if rewritten is None:
                return  # off the loop first (WORK)
            body = rewritten
        self._forward_body(adm, decision, body)

    def _forward_body(self, adm: Admission, decision: Decision, body: bytes) -> None:
        """Decided with the body it read: ``body`` is forwarded, asking for usage first where
        the deployment says so (off the loop when large: WORK)."""
        if self._injecting and decision.ctx is not None and self._asks_usage(decision.deployment, adm.head):
            if len(body) > INLINE_BYTES:
                self._off_loop(adm, decision, _USAGE, partial(_attempt, _include_usage, body, decision.deployment))
                return
            body = _include_usage(body, decision.deployment)
        decision.body = body
        adm._ready(decision)

    def _asks_usage(self, dep: Deployment, head: RequestHead) -> bool:
        """Whether the body of this admitted request is patched to ask for usage: its deployment
        says so (``usage.include_usage``) and it is a POST to a ``.../chat/completions`` path."""
        if head.method != "POST" or not self.accounting.injects(dep.name):
            return False
        return head.target.partition(b"?")[0].rstrip(b"/").endswith(b"/chat/completions")

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

    def _admit(self, adm: Admission, dep: Deployment, ident: Identity, rec: ApiSession | None) -> Decision:
        """Admit a request to ``dep`` (after :meth:`_check_session`, in the same synchronous
        step): begin its turn (``adm`` holds it from then on), ask the mode."""
        session = ident.session
        if session is None:
            return _sessionless(dep)
        parent, root_hint = ident.parent, ident.root
        if rec is not None:
            self.store.begin(rec)
            if dep.strict or rec.parent is not None:
                parent, root_hint = rec.parent, None  # the API's lineage wins
                if parent is not None and rec.root is not None and rec.root != parent:
                    # its parent may have had no request yet: the tree learns the parent's root
                    self.tree.place_parent(session, parent, rec.root, dep.name)
        turn, evicted = self.tree.begin(
            session, parent=parent, root_hint=root_hint, final=ident.final, deployment=dep.name
        )
        adm.turn = turn
        adm.api_session = rec
        if self._shared:
            self.state.begun(turn)
        if evicted:
            self._ended(evicted)
        ctx = turn.ctx
        decision = _decision(dep, dep.only_upstream or dep.pick_upstream(ctx.root), dep.drop, ctx)
        mode = dep.mode
        if mode is None:
            if dep.strict and self._primary_session_header:
                decision.add = ((self._primary_session_header, ctx.session),)  # the validated id
            return decision
        try:
            add = tuple(mode.request_headers(ctx))  # no copy when the mode returned a tuple
            if add:
                _check_added(add)
        except Exception as exc:  # (the admission releases the turn)
            raise self._mode_failed(adm, dep, "request_headers", exc) from exc
        if add and dep.trust_client_headers:
            # A trusted client's own copy wins: keep it and add nothing under that name.
            add = _not_sent_by_client(add, adm.head.headers)
        if add:
            decision.add = add
            dep.stats.headers_injected.inc()
        return decision

    def _rewrite(self, adm: Admission, decision: Decision, scanned: ScannedBody) -> bytes | None:
        """The body-mode rewrite of an admitted request: a JSON object body gets the mode's
        patch spliced in (or goes through its ``transform_body``); any other body passes
        unchanged (or is refused, as the deployment says). A large body's rewrite runs off the
        loop: None, and the admission needs that WORK."""
        dep = decision.deployment
        mode = dep.mode
        ctx = decision.ctx
        assert mode is not None and ctx is not None
        body = scanned.data
        if not scanned.is_object:
            return self._not_object(decision, body, scanned.status == INVALID)
        if dep.name not in self._patching:
            if len(body) > INLINE_BYTES:
                return self._off_loop(adm, decision, _TRANSFORM, partial(_attempt, _transform, mode, ctx, body))
            return self._transformed(adm, decision, body, _attempt(_transform, mode, ctx, body))
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
            raise self._mode_failed(adm, dep, "body_patch", exc) from exc
        if fields is None:
            dep.stats.rewritten().inc()
            return body
        path, values, owned = fields.path, fields.values, fields.owned
        if path[0] not in self._patch_roots:
            self._locate_root(path[0])
        if len(body) > INLINE_BYTES:
            return self._off_loop(adm, decision, _SPLICE, partial(_attempt, splice, scanned, path, values, owned))
        try:  # (_attempt, inline: no Python-level call on the usual, small-body path)
            outcome: tuple[Any, Exception | None] = splice(scanned, path, values, owned), None
        except Exception as exc:
            outcome = None, exc
        return self._spliced(adm, decision, outcome)

    @staticmethod
    def _off_loop(adm: Admission, decision: Decision, step: int, work: Callable[[], Any]) -> None:
        adm.decision = decision
        adm.step = step
        adm._wait(WORK, None, 0, work)

    def _spliced(self, adm: Admission, decision: Decision, outcome: tuple[Any, Exception | None]) -> bytes:
        new, exc = outcome
        if exc is not None:
            raise self._body_failed(adm, decision, "body_patch", exc) from exc
        decision.deployment.stats.rewritten().inc()
        return new

    def _transformed(
        self, adm: Admission, decision: Decision, body: bytes, outcome: tuple[Any, Exception | None]
    ) -> bytes:
        new, exc = outcome
        if exc is not None:
            raise self._body_failed(adm, decision, "transform_body", exc) from exc
        if new is None:  # valid JSON that orjson refuses to parse (1e400, an unpaired surrogate escape)
            return self._not_object(decision, body, True)
        decision.deployment.stats.rewritten().inc()
        return new

    def _body_failed(self, adm: Admission, decision: Decision, hook: str, exc: Exception) -> errors.ProxyError:
        """The error that answers a failed body rewrite: the client's body, or the mode."""
        if isinstance(exc, RepeatedKeys):
            return _repeated_keys(decision.deployment, str(exc))
        return self._mode_failed(adm, decision.deployment, hook, exc)

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

    def _record_worker(self, adm: Admission, turn: Turn, worker: str) -> None:
        worker = fit_id(worker, MAX_WORKER_BYTES)
        interned = self._workers.get(worker)
        if interned is None:
            interned = worker
            if len(self._workers) < MAX_INTERNED_WORKERS:
                self._workers[worker] = worker
        outcome, previous = self.tree.record_worker(turn, interned)
        if self._shared:
            self.state.touched(turn)
        self.metrics.affinity_turn(adm.deployment.name, outcome).inc()
        if outcome == "moved":
            extra: dict[str, Any] = {
                "event": "moved",
                **adm.log_fields(),
                "from_worker": previous,
                "to_worker": interned,
                "turn": turn.ctx.turn,
            }
            if _debug_on():  # session ids only at debug level
                extra["session"] = turn.ctx.session
            log.info("session moved to another worker", extra=extra)

    def _mode_failed(self, adm: Admission, dep: Deployment, hook: str, exc: Exception) -> errors.ProxyError:
        """Count and log a mode hook's failure (of ``dep``'s mode); the error that answers the request."""
        self.metrics.plugin_errors.labels(dep.mode_name, hook).inc()
        extra = {"request_id": adm.request_id, "deployment": dep.name, "mode": dep.mode_name, "hook": hook}
        log.error("mode %s failed in %s: %r", dep.mode_name, hook, exc, extra=extra)
        return errors.ProxyError(
            errors.MODE_ERROR,
            f"routing mode {dep.mode_name!r} failed in {hook}: {exc}",
            mode=dep.mode_name,
            deployment=dep.name,
        )

    def _release(self, turn: Turn, rec: ApiSession | None, outcome: TurnOutcome) -> None:
        """Release what an admitted request held: its turn, and its API session if any."""
        if rec is not None:
            self.store.finish(rec)
        ended = self.tree.finish(turn, outcome)
        if self._shared:
            self.state.finished(turn)
        if ended:
            self._ended(ended)

    def _account(self, dep: Deployment, turn: Turn, usage: Usage) -> None:
        """Count what a response of ``turn`` said of its prompt-cache usage: for its session (its
        tree's node, the shared store), its deployment and its turn."""
        reported = usage.reported
        if reported:
            self.tree.record_usage(turn, usage.prompt_tokens, usage.cached_tokens)
        else:
            self.tree.record_unknown_usage(turn)
        if self._shared:
            self.state.used(turn, usage.prompt_tokens, usage.cached_tokens, reported)
        self.accounting.count(dep.name, dep.mode_name, turn.ctx.turn, usage)

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
        """Sessions that ended in the tree: the state runs them now, or, with a shared store,
        claims them first."""
        self.state.ended(ended)


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


def _include_usage(data: bytes | list[bytes], dep: Deployment) -> bytes:
    """The body to forward for a request that asks for usage (``usage.include_usage``): a
    streamed chat completion gets ``stream_options.include_usage: true``
    (:func:`~sidecar.accounting.with_include_usage`); any other body, or one larger than the
    deployment's ``limits.max_parsed_body_bytes``, unchanged. Reads only its arguments: runs on
    the body pool for a body larger than :data:`~sidecar.jsonscan.INLINE_BYTES`."""
    body = data if isinstance(data, bytes) else join(data)
    if len(body) > dep.max_parsed_body_bytes:
        return body
    patched = with_include_usage(body, dep.max_json_depth)
    return body if patched is None else patched


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
    """Whether the request may carry a body (what an admission that needs the body reads)."""
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


_UPSTREAM_FAILED = TurnOutcome.UPSTREAM_FAILED  # (an Enum member read from its class costs a lookup)
_CONTENT_LENGTH = h.CONTENT_LENGTH.lower()
_CONTENT_ENCODING = h.CONTENT_ENCODING.lower()
_CONTENT_TYPE = h.CONTENT_TYPE.lower()
_REQUEST_ID = h.X_REQUEST_ID.lower()
_TRANSFER_ENCODING = h.TRANSFER_ENCODING.lower()
# Header names modes asked to add, checked once each (_check_added); bounded.
_ADDABLE: dict[str, bool] = {}
MAX_ADDABLE = 256
