"""The session lineage tree: nodes, finality facts, end of session, expiry, tombstones.

Pure and synchronous: no I/O and no awaits, so one event loop drives it without locks. Time
comes only from the injected ``clock`` (seconds, monotonic). Every operation is O(1) amortized
per request.

When each call runs, and what it returns:

- :meth:`SessionTree.begin` runs when a request that names a session arrives, before it is
  forwarded. It returns the request's :class:`Turn` (whose ``ctx`` is the request's routing context)
  and the sessions evicted to stay under ``max_live``.
- :meth:`SessionTree.finish` runs strictly after the last response byte was written, or once
  the request failed or its client left. A session ends there when its final turn is over and
  nothing else of it is in flight, or when it was closed while in flight.
- :meth:`SessionTree.close`, :meth:`SessionTree.expire` and :meth:`SessionTree.shutdown` run
  between requests (sessions API, periodic sweep, after the drain).

Every real session ends exactly once: the call that ends it returns one :class:`SessionEnd` for it,
and the caller runs the end-of-session hooks. Placeholders (nodes created only because a child
or a root hint named them) never had a request: they produce no :class:`SessionEnd` and are dropped
silently when their last descendant leaves.

Lineage is fixed by a session's first request. A child naming an unknown parent creates a
placeholder parent; a session with no parent whose root hint names another id joins that id's
tree (placed under its root, still reported with ``parent=None``). A root hint that contradicts
the root derived from the parent chain is counted in ``root_conflicts`` and the derived root is
kept. A later ``parent`` on an existing session is ignored.

One node per id is linked in the trees, the one :meth:`SessionTree.get` returns, so the newest
session of every id is reachable from its tree's root id. The lineage of an id is fixed while
its node is held: a new session on the id of a node still in a tree (ended but held for live
descendants, or closed and still draining) takes that node's place, with the same parent and
children and fresh per-session fields; the parent and root hint its first request declares are
ignored (the descendants' root, which picks their upstream, must not change under them). A
draining node so replaced is detached: linked nowhere (no view shows it), it still counts in its
tree's live and in-flight counters until its last request ends it, exactly once.

Memory is bounded. ``max_live`` caps the nodes held in trees: live sessions, placeholders, and
ended sessions kept because live descendants still hang below them (shown with ``ended=True``).
Above the cap the least recently active idle session is evicted; sessions with requests in
flight are never evicted, so when everything is in flight the cap is exceeded until requests
finish. Evicting a session with children frees nothing (it stays as their ancestor), so while
such ancestors fill half the cap a new session's parent is ignored (:meth:`SessionTree._crowded`):
a chain of parents cannot grow the tree past the cap. Ended ids are tombstoned, bounded by
``tombstone_max`` (oldest dropped first) and by ``tombstone_ttl`` (pruned by
:meth:`SessionTree.expire`); a request on a tombstoned id starts a new session.
"""

from __future__ import annotations

import heapq
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sidecar.compiled import is_compiled
from sidecar.context import EndReason, RoutingContext, SessionEnd, SessionFlag, TurnOutcome

__all__ = [
    "Clock",
    "SHARED_FLAGS",
    "SessionNode",
    "SessionTree",
    "Turn",
    "TreeView",
    "VIEW_STEP",
    "exhaust",
    "prompt_cache",
    "subtree_totals",
    "unknown_node",
    "FORGETTING",
]

Clock = Callable[[], float]

log = logging.getLogger("sidecar.lineage")


_FINAL_TURN_REASON = {
    TurnOutcome.COMPLETED: EndReason.FINAL_TURN_COMPLETED,
    TurnOutcome.UPSTREAM_FAILED: EndReason.FINAL_TURN_FAILED,
    TurnOutcome.CLIENT_ABORTED: EndReason.CLIENT_ABANDONED,
}
# With a shared store, these local ends only forget the node (the store ends sessions fleet-wide).
FORGETTING = frozenset({EndReason.IDLE_EXPIRED, EndReason.EVICTED, EndReason.SHUTDOWN})


@dataclass(slots=True)
class TreeView:
    """One tree as :meth:`SessionTree.view` built it, with counts over the whole tree."""

    tree: dict[str, Any]  # the root's node dict, shown descendants nested under "children"
    sessions: int  # nodes of the tree: sessions, placeholders, ended sessions held for descendants
    live: int  # sessions neither ended nor placeholders
    final: bool  # every one of those has begun its final turn
    in_flight: int
    last_active_at: float  # the newest activity of any node
    shown: int
    omitted: int  # how many nodes the view cut (sessions - shown)


T = TypeVar("T")


def exhaust(steps: Generator[None, None, T]) -> T:
    """Run a view builder of :class:`SessionTree` to its end without pausing; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


# Nodes a view builder touches between two pauses.
VIEW_STEP = 128
_SHOW, _CUT = 0, 1  # how a view builder's walk treats a node: shown, or only counted

# Runs of consecutive turns on one worker kept per session for the affinity history (most recent
# last). A session whose affinity holds has one run, so the common case costs one short list.
WORKER_RUNS = 8

# Compiled, nodes are not tracked by the cyclic garbage collector (see SessionNode.__init__).
_COMPILED = is_compiled(sys.modules[__name__])


# The flags as plain ints for the per-request code (compiled: C constants, lineage.pxd).
_PLACEHOLDER = int(SessionFlag.PLACEHOLDER)
_FINAL_SEEN = int(SessionFlag.FINAL_SEEN)
_CLOSED = int(SessionFlag.CLOSED)
_ENDED = int(SessionFlag.ENDED)
_HINTED = int(SessionFlag.HINTED)
_CONFLICT = int(SessionFlag.CONFLICT)
_DETACHED = int(SessionFlag.DETACHED)
_NOT_JOINABLE = _PLACEHOLDER | _CLOSED | _ENDED  # begin() on such a node starts a session
_DONE = _PLACEHOLDER | _ENDED  # held only while descendants are
# What a shared store keeps of a node's flags (the rest is the tree's own, or the store's).
SHARED_FLAGS = _FINAL_SEEN | _HINTED


class SessionNode:
    """One session id in a tree. Kept small: the tree holds up to ``max_live`` of them.

    Read-only outside this module, where a shared store reads what it writes behind:
    ``session``, ``parent`` (a node), ``deployment``, ``created_at`` / ``last_active_at`` (the
    tree's clock), ``turns``, ``in_flight``, ``flags`` (:class:`SessionFlag`), ``mode_state``,
    ``workers`` / ``worker_turns`` / ``moves``, and the prompt-cache accounting:
    ``prompt_tokens`` / ``cached_tokens`` summed over ``usage_turns`` (turns whose response
    reported both), ``unknown_turns`` (turns answered without usable usage; see
    :mod:`sidecar.usage`). Everything else is the tree's.

    ``parent`` is the structural parent (for a hinted session, the node of its root hint).
    ``root`` is a union-find link towards the tree's root node (the root points to itself);
    read it through :meth:`SessionTree._root_of`. ``tree_live`` / ``tree_in_flight`` are the
    tree's counters, kept on the root node only. Children form a doubly linked sibling list;
    idle live sessions form the LRU list through ``lru_prev`` / ``lru_next``.
    """

    __slots__ = (
        "session",
        "parent",
        "root",
        "deployment",
        "created_at",
        "last_active_at",
        "turns",
        "in_flight",
        "flags",
        "end_reason",
        "first_child",
        "next_sibling",
        "prev_sibling",
        "lru_prev",
        "lru_next",
        "tree_live",
        "tree_in_flight",
        "mode_state",
        "workers",
        "worker_turns",
        "moves",
        "prompt_tokens",
        "cached_tokens",
        "usage_turns",
        "unknown_turns",
    )

    def __init__(self, session: str, deployment: str, now: float, flags: int) -> None:
        self.session = session
        self.parent: SessionNode | None = None
        self.root: SessionNode = self
        self.deployment = deployment
        self.created_at = now
        self.last_active_at = now
        self.turns = 0
        self.in_flight = 0
        self.flags = flags
        # the end reason once ended; before that, the reason it will end with when it drains
        self.end_reason: EndReason | None = None
        self.first_child: SessionNode | None = None
        self.next_sibling: SessionNode | None = None
        self.prev_sibling: SessionNode | None = None
        self.lru_prev: SessionNode | None = None
        self.lru_next: SessionNode | None = None
        self.tree_live = 1
        self.tree_in_flight = 0
        # what the deployment's mode asked to remember for this session (e.g. a gateway token)
        self.mode_state: str | None = None
        # affinity: the last WORKER_RUNS runs of turns on one worker, flattened as
        # [worker, turns, ...]; how many turns named a worker; how many moved off the previous one
        self.workers: list[str | int] | None = None
        self.worker_turns = 0
        self.moves = 0
        # prompt-cache accounting (see the class docstring)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.usage_turns = 0
        self.unknown_turns = 0
        # Out of the cyclic garbage collector: a full collection would otherwise walk every held
        # node (about 0.2 s at a million sessions, all streams stalled meanwhile). Nothing needs
        # it: a node leaving the tree is unlinked from every other node (SessionTree._release),
        # so reference counting frees it.
        _uncollected(self)


def _uncollected(obj: T) -> T:
    """``obj``, compiled: no longer tracked by the cyclic garbage collector, which full
    collections then do not walk (source build: unchanged). Only for what the tree holds and
    no reference cycle can run through: its nodes, their worker runs (strings and ints, a
    shared store's copy freshly decoded JSON) and its index (strings and nodes). A list stays
    untracked whatever is put in it; a dict is tracked again by inserting a node."""
    if _COMPILED:
        PyObject_GC_UnTrack(obj)  # type: ignore[name-defined]  # noqa: F821  # cimported (lineage.pxd)
    return obj


# What a released root's ``root`` points to instead of itself (see SessionTree._release).
_RELEASED = SessionNode("", "", 0.0, 0)


def _lru_append(lru: SessionNode, node: SessionNode) -> None:
    """Link ``node`` as the most recently used idle session (``lru`` is the list's sentinel)."""
    tail = lru.lru_prev
    assert tail is not None
    node.lru_prev = tail
    node.lru_next = lru
    tail.lru_next = node
    lru.lru_prev = node


class Turn:
    """Handle of one in-flight request; hand it back to :meth:`SessionTree.finish`. Made by
    :meth:`SessionTree.begin` (``ctx``; ``node``, its session's node, read-only; ``_final``,
    ``_open``)."""

    __slots__ = ("ctx", "node", "_final", "_open")

    ctx: RoutingContext
    node: SessionNode
    _final: bool
    _open: bool

    def __repr__(self) -> str:
        return f"Turn({self.ctx!r}, open={self._open})"


class SessionTree:
    """Every live session's lineage, the per-tree counters behind the finality facts, and
    the end-of-session bookkeeping. See the module docstring for the contract."""

    def __init__(
        self,
        *,
        idle_ttl: float = 900.0,
        max_live: int = 100_000,
        tombstone_max: int = 100_000,
        tombstone_ttl: float = 600.0,
        clock: Clock = time.monotonic,
        shared: bool = False,
    ) -> None:
        if not idle_ttl > 0:
            raise ValueError(f"idle_ttl: must be > 0 (got {idle_ttl!r})")
        if max_live < 1:
            raise ValueError(f"max_live: must be >= 1 (got {max_live!r})")
        if tombstone_max < 0:
            raise ValueError(f"tombstone_max: must be >= 0 (got {tombstone_max!r})")
        if tombstone_ttl < 0:
            raise ValueError(f"tombstone_ttl: must be >= 0 (got {tombstone_ttl!r})")
        self._idle_ttl = idle_ttl
        self._max_live = max_live
        self._tombstone_max = tombstone_max
        self._tombstone_ttl = tombstone_ttl
        self._clock = clock
        # A shared store (sidecar.state) keeps the sessions: this tree is its cache here. Idle
        # expiry, eviction and shutdown then only forget nodes (no tombstone: the next request
        # of the id asks the store), and :meth:`seed` places sessions the store knows.
        self._shared = shared
        # id -> newest node of that id still held in a tree (live, placeholder, closing, or
        # ended with live descendants)
        self._nodes: dict[str, SessionNode] = {}
        # sentinel of the circular LRU list of idle live sessions, least recently active first
        # (compiled, one node no collector frees either: it lives as long as its tree, in a
        # sidecar as long as the process)
        self._lru = SessionNode("", "", 0.0, 0)
        self._lru.lru_prev = self._lru.lru_next = self._lru
        # ended id -> clock value when it was tombstoned, oldest first
        self._tombs: OrderedDict[str, float] = OrderedDict()
        # id -> closed sessions of that id still draining, whose place a newer session of the id
        # took over (flagged _DETACHED; their requests still count in :meth:`in_flight_of`)
        self._detached: dict[str, list[SessionNode]] = {}
        self._live = 0  # live sessions, placeholders included
        self._held_ended = 0  # ended nodes kept as ancestors of live ones
        self._trees = 0
        self._conflict_logged = False
        self.evictions = 0
        self.tombstone_reuses = 0
        self.root_conflicts = 0
        self.lineage_dropped = 0  # sessions whose parent was ignored (see _crowded)
        self.ended_by_reason: dict[EndReason, int] = dict.fromkeys(EndReason, 0)

    # -- read-only stats -------------------------------------------------------------------------

    @property
    def live_sessions(self) -> int:
        """Sessions not yet ended, placeholders included."""
        return self._live

    @property
    def held_ancestors(self) -> int:
        """Ended sessions kept as ancestors of live ones (they count in ``max_live`` too)."""
        return self._held_ended

    @property
    def live_trees(self) -> int:
        """Trees currently held (each has at least one live session)."""
        return self._trees

    @property
    def tombstones(self) -> int:
        """Ended ids currently remembered."""
        return len(self._tombs)

    # -- request path ----------------------------------------------------------------------------

    def begin(
        self, session: str, parent: str | None, root_hint: str | None, final: bool, deployment: str
    ) -> tuple[Turn, Sequence[SessionEnd]]:
        """Register one request of ``session`` and compute its routing context.

        Returns its turn and the sessions evicted to make room (the caller ends them).
        """
        # Flattened: this runs once per request of a session.
        now = self._clock()
        node = self._nodes.get(session)
        evicted: Sequence[SessionEnd] = ()  # nearly always nothing: no list to allocate
        if node is None or node.flags & _NOT_JOINABLE:
            node = self._place(session, node, parent, root_hint, deployment, now)
            if self._live + self._held_ended > self._max_live:
                evicted = self._evict(now)
        root = node.root
        if root.root is not root:
            root = self._root_of(node)
        flags = node.flags
        if root_hint is not None and root_hint != root.session and not flags & _CONFLICT:
            flags |= _CONFLICT
            self._root_conflict(node.session, root_hint, root.session)
        if final:
            flags |= _FINAL_SEEN
        node.flags = flags
        in_flight = node.in_flight
        if not in_flight:
            prev, nxt = node.lru_prev, node.lru_next
            if nxt is not None:  # an idle session leaves the LRU list (inlined _lru_unlink)
                assert prev is not None
                prev.lru_next = nxt
                nxt.lru_prev = prev
                node.lru_prev = node.lru_next = None
        node.in_flight = in_flight + 1
        root.tree_in_flight += 1
        turns = node.turns = node.turns + 1
        node.last_active_at = now
        parent_node = node.parent
        if parent_node is None or flags & _HINTED:
            parent_id = None
            parent_final = None
        else:
            parent_id = parent_node.session
            pflags = parent_node.flags
            parent_final = None if pflags & _PLACEHOLDER else bool(pflags & (_FINAL_SEEN | _CLOSED | _ENDED))
        # Built field by field: compiled, an allocation and stores (calling a class packs its
        # arguments into a tuple and parses them, several hundred instructions per request).
        ctx = RoutingContext.__new__(RoutingContext)
        ctx.session = node.session
        ctx.parent = parent_id
        ctx.root = root.session
        ctx.is_final_turn = final
        ctx.is_parent_final = parent_final
        ctx.is_tree_final = final and root.tree_live == 1 and root.tree_in_flight == 1
        ctx.turn = turns
        ctx.deployment = deployment
        ctx.mode_state = node.mode_state
        turn = Turn.__new__(Turn)
        turn.ctx = ctx
        turn.node = node
        turn._final = final
        turn._open = True
        return turn, evicted

    def finish(self, turn: Turn, outcome: TurnOutcome) -> list[SessionEnd]:
        """The request of ``turn`` is over. Idempotent: a second call returns []."""
        if not turn._open:
            return []
        turn._open = False
        node = turn.node
        if node.flags & _ENDED:  # evicted or shut down while this request was in flight
            return []
        now = self._clock()
        node.last_active_at = now
        in_flight = node.in_flight = node.in_flight - 1
        root = node.root
        if root.root is not root:
            root = self._root_of(node)
        root.tree_in_flight -= 1
        if turn._final and node.end_reason is None:
            node.end_reason = _FINAL_TURN_REASON[outcome]
        if in_flight:
            return []
        if node.end_reason is not None:
            return [self._end(node, node.end_reason, now)]
        _lru_append(self._lru, node)
        return []

    def set_mode_state(self, turn: Turn, state: str) -> None:
        """Remember ``state`` for the session of ``turn`` (handed to its later turns' routing contexts)."""
        node = turn.node
        if not node.flags & _ENDED:
            node.mode_state = state

    def record_worker(self, turn: Turn, worker: str) -> tuple[str, str | None]:
        """The upstream worker that served ``turn``; returns the affinity outcome (``first``,
        ``same_worker`` or ``moved``) and the session's previous worker."""
        node = turn.node
        runs = node.workers  # [worker, turns, worker, turns, ...]
        node.worker_turns += 1
        if runs is None:
            first: list[str | int] = [worker, 1]
            node.workers = _uncollected(first)
            return "first", None
        # runs alternate worker names (str) and turn counts (int): no conversion on this path
        previous: str = runs[-2]  # type: ignore[assignment]
        if previous == worker:
            runs[-1] += 1  # type: ignore[operator]
            return "same_worker", previous
        if len(runs) >= 2 * WORKER_RUNS:
            del runs[0:2]
        runs.append(worker)
        runs.append(1)
        node.moves += 1
        return "moved", previous

    def record_usage(self, turn: Turn, prompt_tokens: int, cached_tokens: int) -> None:
        """The response of ``turn`` reported ``prompt_tokens``, ``cached_tokens`` of them found
        in the upstream's prefix cache (non-negative, ``cached_tokens <= prompt_tokens``)."""
        node = turn.node
        if not node.flags & _ENDED:
            node.prompt_tokens += prompt_tokens
            node.cached_tokens += cached_tokens
            node.usage_turns += 1

    def record_unknown_usage(self, turn: Turn) -> None:
        """The response of ``turn`` said nothing usable of its prompt-cache usage."""
        node = turn.node
        if not node.flags & _ENDED:
            node.unknown_turns += 1

    # -- session lifecycle -----------------------------------------------------------------------

    def close(self, session: str, reason: EndReason = EndReason.API_CLOSED) -> list[SessionEnd]:
        """Close ``session`` through the API (``reason``: why the API ended it).

        Its id is tombstoned at once. Its :class:`SessionEnd` is returned now when nothing of it is in
        flight, otherwise by the :meth:`finish` that drains it; if a final turn already
        finished while other requests were draining, that turn's reason is kept. Unknown,
        placeholder, ended or already closed ids return [].
        """
        node = self._nodes.get(session)
        if node is None or node.flags & _NOT_JOINABLE:
            return []
        now = self._clock()
        node.flags |= _CLOSED
        if node.end_reason is None:
            node.end_reason = reason
        self._tombstone(session, now)
        if node.in_flight:
            return []
        return [self._end(node, node.end_reason, now)]

    def expire(self, limit: int = 1 << 62) -> tuple[list[SessionEnd], bool]:
        """End sessions idle (nothing in flight) for at least ``idle_ttl``; prune old tombstones.

        Walks from the least recently active end and stops at the first session still fresh, or
        after ``limit`` sessions and ``limit`` tombstones (so one call stays short whatever the
        backlog). Returns the ended sessions and whether work was left for another call.
        """
        now = self._clock()
        ended: list[SessionEnd] = []
        cutoff = now - self._idle_ttl
        lru = self._lru
        node = lru.lru_next
        assert node is not None
        left = limit
        while node is not lru and node.last_active_at <= cutoff:
            if not left:
                return ended, True
            left -= 1
            ended.append(self._end(node, EndReason.IDLE_EXPIRED, now))
            node = lru.lru_next
            assert node is not None
        tombs = self._tombs
        cutoff = now - self._tombstone_ttl
        left = limit
        while tombs:
            oldest = next(iter(tombs))
            if tombs[oldest] > cutoff:
                break
            if not left:
                return ended, True
            left -= 1
            del tombs[oldest]
        return ended, False

    def shutdown(self) -> list[SessionEnd]:
        """End every live session with SHUTDOWN, in-flight ones included; afterwards the tree
        holds no node."""
        now = self._clock()
        ended = [self._end(node, EndReason.SHUTDOWN, now) for kin in list(self._detached.values()) for node in kin[:]]
        for node in list(self._nodes.values()):
            if not node.flags & _DONE:
                ended.append(self._end(node, EndReason.SHUTDOWN, now))
        # What is left are placeholders with nothing below them (a shared store's seeds): dropped
        # silently, as always, so that the tree holds nothing (its nodes are freed as it is).
        for node in list(self._nodes.values()):
            if node.first_child is None and self._nodes.get(node.session) is node:
                self._live -= 1
                self._root_of(node).tree_live -= 1
                self._release(node)
        return ended

    # -- views -----------------------------------------------------------------------------------

    def get(self, session: str) -> dict[str, Any] | None:
        """``session``'s node as a JSON-ready dict; None if no tree holds it."""
        node = self._nodes.get(session)
        return None if node is None else self._as_dict(node)

    def node_of(self, session: str) -> SessionNode | None:
        """The newest node of ``session`` held here (a shared store's writer reads its fields)."""
        return self._nodes.get(session)

    def in_flight_of(self, session: str) -> int:
        """Requests of ``session`` in flight here: its node's, and those of closed sessions of
        the id still draining after a newer session took the id over."""
        node = self._nodes.get(session)
        n = 0 if node is None else node.in_flight
        for old in self._detached.get(session, ()):
            n += old.in_flight
        return n

    def held_sessions(self) -> list[str]:
        """Ids of the live sessions this tree holds (not placeholders, closing or ended): what a
        shared store is told again after an outage. O(held nodes)."""
        return [sid for sid, node in self._nodes.items() if not node.flags & _NOT_JOINABLE]

    def facts_of(self, session: str) -> tuple[str, str | None, str, int, int, float, float] | None:
        """A live session's shared facts: (deployment, the id it hangs under, root id, flags
        final-seen and hinted, turns, created, last active); None unless live here."""
        node = self._nodes.get(session)
        if node is None or node.flags & _NOT_JOINABLE:
            return None
        parent = node.parent
        return (
            node.deployment,
            None if parent is None else parent.session,
            self._root_of(node).session,
            node.flags & (_FINAL_SEEN | _HINTED),
            node.turns,
            node.created_at,
            node.last_active_at,
        )

    def root_of(self, session: str) -> str | None:
        """The root id of the tree holding ``session``; None if no tree holds it."""
        node = self._nodes.get(session)
        return None if node is None else self._root_of(node).session

    # The two builders below are generators: they pause (yield None) every ``step`` nodes they
    # touch, so that a caller on the event loop can let requests run in between (the admin
    # listener does, see sidecar/admin/views.py), and return their result (``yield from`` hands it
    # over; :func:`exhaust` runs one without pausing). The tree may change during a pause: the
    # result is then a slightly inconsistent snapshot (a node released meanwhile may still be
    # shown or counted, one added meanwhile may be missed). The walks only follow child lists
    # and root links, which never form cycles, so they end.

    def view(
        self, session: str, *, max_depth: int | None = None, max_nodes: int | None = None, step: int = VIEW_STEP
    ) -> Generator[None, None, TreeView | None]:
        """The tree ``session`` belongs to, from its root: node dicts (as :meth:`get` returns them)
        nested under ``children``, oldest first; at most ``max_nodes`` of them (the root is always
        shown), at most ``max_depth`` levels below the root. A node whose descendants were cut
        carries ``omitted``: how many sessions below it are not shown. A node's shown children are
        chosen together, so earlier siblings and shallower levels win. Returns None when no tree
        holds ``session``.

        Touches every node of the tree once (to count what it cuts) and builds only what it
        shows; without limits it builds the whole tree.
        """
        node = self._nodes.get(session)
        if node is None:
            return None
        top = self._root_of(node)
        depth_limit = sys.maxsize if max_depth is None else max_depth
        budget = (sys.maxsize if max_nodes is None else max_nodes) - 1  # the root is always shown
        out = self._as_dict(top)
        out["children"] = []
        sessions = live = final = in_flight = omitted = 0
        cut: dict[int, list[int]] = {}  # id of a shown node's dict -> usage of the nodes cut below it
        newest = top.last_active_at
        shown = 1
        touched = 0
        pause = step
        # (node, dict, n, how): _SHOW: the node's own dict, n its depth; _CUT: the dict of the
        # shown node it is counted in, n how many of it and its next siblings are cut
        stack: list[tuple[SessionNode, dict[str, Any], int, int]] = [(top, out, 0, _SHOW)]
        while stack:
            node, d, n, how = stack.pop()
            touched += 1
            if touched >= pause:
                pause += step
                yield
            flags = node.flags
            sessions += 1
            if not flags & _DONE:
                live += 1
                if flags & _FINAL_SEEN:
                    final += 1
            in_flight += node.in_flight
            if node.last_active_at > newest:
                newest = node.last_active_at
            child = node.first_child
            if how == _CUT:
                if node.usage_turns or node.unknown_turns:
                    below = cut.get(id(d))
                    if below is None:
                        below = cut[id(d)] = [0, 0, 0, 0]
                    below[0] += node.prompt_tokens
                    below[1] += node.cached_tokens
                    below[2] += node.usage_turns
                    below[3] += node.unknown_turns
                d["omitted"] += 1
                omitted += 1
                sibling = node.next_sibling
                if n > 1 and sibling is not None:
                    stack.append((sibling, d, n - 1, _CUT))
                if child is not None:
                    stack.append((child, d, sys.maxsize, _CUT))
                continue
            if child is None:
                continue
            if n >= depth_limit:
                d["omitted"] = 0
                stack.append((child, d, sys.maxsize, _CUT))
                continue
            kids = []
            while child is not None:
                kids.append(child)
                child = child.next_sibling
                touched += 1
                if touched >= pause:
                    pause += step
                    yield
            keep = min(len(kids), max(budget, 0))
            budget -= keep
            shown += keep
            if keep < len(kids):  # the newest children (first in the list) are cut
                d["omitted"] = 0
                stack.append((kids[0], d, len(kids) - keep, _CUT))
            children = d["children"]
            for i in range(len(kids) - 1, len(kids) - 1 - keep, -1):  # oldest first
                child_dict = self._as_dict(kids[i])
                child_dict["children"] = []
                children.append(child_dict)
                touched += 1
                if touched >= pause:
                    pause += step
                    yield
            for i in range(keep - 1, -1, -1):  # the oldest child is walked first
                stack.append((kids[len(kids) - 1 - i], children[i], n + 1, _SHOW))
        yield from subtree_totals(out, cut, step=step)
        return TreeView(out, sessions, live, final == live, in_flight, newest, shown, omitted)

    def tree(
        self, session: str, *, max_depth: int | None = None, max_nodes: int | None = None
    ) -> dict[str, Any] | None:
        """:meth:`view`'s nested node dicts built in one go (whole trees by default): for tests
        and tools. The admin listener runs :meth:`view` in slices instead."""
        view = exhaust(self.view(session, max_depth=max_depth, max_nodes=max_nodes))
        return None if view is None else view.tree

    def recent_roots(self, limit: int, *, step: int = VIEW_STEP) -> Generator[None, None, list[str]]:
        """Root ids of the held trees, the most recently active tree first (a tree's activity is
        the newest ``last_active_at`` of its nodes), at most ``limit``. A builder like
        :meth:`view`; touches every held node once."""
        return [session for session, _ in (yield from self.recent_trees(limit, step=step))]

    def recent_trees(self, limit: int, *, step: int = VIEW_STEP) -> Generator[None, None, list[tuple[str, float]]]:
        """:meth:`recent_roots` with each tree's activity: (root id, newest ``last_active_at``)."""
        nodes = self._nodes
        held = list(nodes.values())  # one C-level copy: the dict may change while the walk pauses
        newest: dict[SessionNode, float] = {}  # tree root -> the tree's newest activity
        countdown = step
        for node in held:
            countdown -= 1
            if not countdown:
                countdown = step
                yield
            if nodes.get(node.session) is not node:
                continue  # released during a pause
            top = self._root_of(node)  # path compression only shortens links: safe from a view
            at = node.last_active_at
            seen = newest.get(top)
            if seen is None or at > seen:
                newest[top] = at
        heap: list[tuple[float, str]] = []
        for top, at in newest.items():
            countdown -= 1
            if not countdown:
                countdown = step
                yield
            if nodes.get(top.session) is not top or top.root is not top:
                continue  # released, or joined another tree, during a pause
            if len(heap) < limit:
                heapq.heappush(heap, (at, top.session))
            elif (at, top.session) > heap[0]:
                heapq.heapreplace(heap, (at, top.session))
        heap.sort(reverse=True)
        return [(session, at) for at, session in heap]

    def now(self) -> float:
        """The tree's clock (node timestamps are on it)."""
        return self._clock()

    def bound_deployment(self, session: str) -> str | None:
        """The deployment a live session was bound to by its first request; None when ``session``
        is unknown, a placeholder, closed or ended (its next request starts a new session)."""
        node = self._nodes.get(session)
        if node is None or node.flags & _NOT_JOINABLE:
            return None
        return node.deployment

    def joinable(self, session: str) -> bool:
        """A request of ``session`` continues a session this tree holds (live, not a placeholder,
        closing or ended): nothing needs to be asked elsewhere."""
        node = self._nodes.get(session)
        return node is not None and not node.flags & _NOT_JOINABLE

    def seed(
        self,
        session: str,
        above: str | None,
        root: str,
        *,
        hinted: bool,
        deployment: str,
        turns: int,
        final_seen: bool,
        created: float,
        last_active: float,
        mode_state: str | None,
        workers: list[str | int] | None = None,
        worker_turns: int = 0,
        moves: int = 0,
        placeholder: bool = False,
        usage: tuple[int, int, int, int] = (0, 0, 0, 0),
    ) -> None:
        """Place a session the shared store knows (sidecar.state) into this tree, with its facts
        (times on this tree's clock): under ``above`` (its parent, or its root hint when
        ``hinted``), itself placed under ``root`` as a placeholder when this tree does not hold
        it. ``usage``: its prompt-cache accounting (prompt and cached tokens, turns with usage,
        unknown turns). A placeholder stays one (``placeholder``); a live session joins the idle list like
        any session after a request. No-op when this tree holds the id, other than as a
        placeholder (what happened here wins)."""
        node = self._nodes.get(session)
        if node is not None and not node.flags & _PLACEHOLDER:
            return
        now = self._clock()
        above_node = None
        if above is not None and above != session:
            above_node = self._nodes.get(above)
            if above_node is None:
                above_node = self._known_or_placeholder(above, deployment, now)
                if root != above and root != session:
                    self._attach(above_node, self._known_or_placeholder(root, deployment, now), 0)
        if node is None:
            node = self._known_or_placeholder(session, deployment, now)
        if above_node is not None and node.root is node:
            self._attach(node, above_node, _HINTED if hinted else 0)
        if placeholder:
            return
        node.flags = (node.flags & ~_PLACEHOLDER) | (_FINAL_SEEN if final_seen else 0)
        node.deployment = deployment
        node.turns = turns
        node.created_at = created
        node.last_active_at = last_active
        node.mode_state = mode_state
        node.workers = None if workers is None else _uncollected(workers)
        node.worker_turns = worker_turns
        node.moves = moves
        node.prompt_tokens, node.cached_tokens, node.usage_turns, node.unknown_turns = usage
        _lru_append(self._lru, node)

    def place_parent(self, session: str, parent: str, root: str, deployment: str) -> None:
        """Before the first request of ``session``, whose declared ``parent`` this tree does not
        hold: hold ``parent`` as a placeholder below ``root`` (a placeholder too when unknown),
        so that the request joins ``root``'s tree. For lineage known elsewhere than from
        requests (an API session whose parent, created with a parent of its own, had no request
        yet), as :meth:`seed` places what a shared store knows. No-op when ``session`` is held
        (other than as a placeholder), when ``parent`` is, or when new sessions' lineage is
        ignored (see :meth:`_crowded`): the request then places ``session`` as it would have."""
        node = self._nodes.get(session)
        if (node is not None and not node.flags & _PLACEHOLDER) or parent in self._nodes or root == parent:
            return
        if root == session or self._crowding():
            return
        now = self._clock()
        self._attach(
            self._known_or_placeholder(parent, deployment, now), self._known_or_placeholder(root, deployment, now), 0
        )

    def named_only(self, session: str) -> bool:
        """True when this tree holds ``session`` only as a placeholder: named by a child or a
        root hint, no request of its own."""
        node = self._nodes.get(session)
        return node is not None and bool(node.flags & _PLACEHOLDER)

    def is_closed(self, session: str) -> bool:
        """True while ``session`` is tombstoned: ended or closed, and not yet forgotten."""
        return session in self._tombs

    # -- internals -------------------------------------------------------------------------------

    def _place(
        self,
        session: str,
        old: SessionNode | None,
        parent: str | None,
        root_hint: str | None,
        deployment: str,
        now: float,
    ) -> SessionNode:
        """Place the first request of a session: a new id, a placeholder, or the id of a node
        still held (ended with live descendants, or closed and draining)."""
        reused = self._tombs.pop(session, None) is not None
        if old is not None:
            if old.flags & _PLACEHOLDER:
                if reused:
                    self.tombstone_reuses += 1
                return self._promote(old, parent, root_hint, deployment, now)
            self.tombstone_reuses += 1
            if parent is not None and (old.parent is None or old.parent.session != parent):
                log.debug(
                    "session %s reuses the id of a node still in its tree; its declared parent %s is ignored",
                    session,
                    parent,
                )
            if old.flags & _ENDED:
                return self._revive(old, deployment, now)
            return self._take_over(old, deployment, now)
        if reused:
            self.tombstone_reuses += 1
        node = SessionNode(session, deployment, now, 0)
        self._index(session, node)
        self._live += 1
        if (parent is not None or root_hint is not None) and self._crowded():
            parent = root_hint = None
        if parent is not None and parent != session:
            above = self._known_or_placeholder(parent, deployment, now)
        elif root_hint is not None and root_hint != session:
            above = self._known_or_placeholder(root_hint, deployment, now)
            node.flags = _HINTED
        else:
            self._trees += 1
            return node
        root = self._root_of(above)
        node.root = root
        node.tree_live = 0
        self._link_child(above, node)
        root.tree_live += 1
        return node

    def _promote(
        self, node: SessionNode, parent: str | None, root_hint: str | None, deployment: str, now: float
    ) -> SessionNode:
        """A placeholder sends its own first request; its whole tree may join another one."""
        node.flags &= ~_PLACEHOLDER
        node.deployment = deployment
        if (parent is not None or root_hint is not None) and self._crowded():
            return node
        if parent is not None and parent != node.session:
            above = self._known_or_placeholder(parent, deployment, now)
            hinted = 0
        elif root_hint is not None and root_hint != node.session:
            above = self._known_or_placeholder(root_hint, deployment, now)
            hinted = _HINTED
        else:
            return node
        self._attach(node, above, hinted)
        return node

    def _attach(self, node: SessionNode, above: SessionNode, hinted: int) -> None:
        """Hang the root ``node`` and its whole tree below ``above`` (its tree joins ``above``'s),
        unless ``above`` is in ``node``'s own tree."""
        root = self._root_of(above)
        if root is node:
            log.debug("session %s names its own descendant %s above it; lineage ignored", node.session, above.session)
            return
        node.flags |= hinted
        node.root = root
        self._link_child(above, node)
        root.tree_live += node.tree_live
        root.tree_in_flight += node.tree_in_flight
        node.tree_live = node.tree_in_flight = 0
        self._trees -= 1

    def _revive(self, node: SessionNode, deployment: str, now: float) -> SessionNode:
        """A new session takes the id of an ended node held for its live descendants: it takes
        the node over in place (parent, children and root stay), with fresh per-session fields.
        An ended node has nothing in flight (only shutdown ends sessions with requests in
        flight, and no request begins after it), so no older turn can reach the new session."""
        node.flags &= _HINTED
        node.deployment = deployment
        node.created_at = node.last_active_at = now
        node.turns = 0
        node.end_reason = None
        node.mode_state = None
        node.workers = None
        node.worker_turns = node.moves = 0
        node.prompt_tokens = node.cached_tokens = node.usage_turns = node.unknown_turns = 0
        self._held_ended -= 1
        self._live += 1
        self._root_of(node).tree_live += 1
        return node

    def _take_over(self, old: SessionNode, deployment: str, now: float) -> SessionNode:
        """A new session takes the id of a closed session still draining: a new node takes the
        old one's place (parent link, children, and the tree's counters when it was the root),
        and the old node is detached to drain alone; it still counts in its tree until it ends.
        Costs one step per child of the old node (a rare path: a close, then the id reused
        while the closed session's requests are still in flight)."""
        node = SessionNode(old.session, deployment, now, old.flags & _HINTED)
        self._index(old.session, node)
        self._detached.setdefault(old.session, []).append(old)
        self._live += 1
        parent = old.parent
        if parent is None:  # the old node was its tree's root: the new one becomes the root
            node.tree_live = old.tree_live + 1
            node.tree_in_flight = old.tree_in_flight
            old.tree_live = old.tree_in_flight = 0
            old.root = node  # every union-find path into the old root now leads to the new one
        else:
            root = self._root_of(old)
            node.root = root
            node.tree_live = 0
            root.tree_live += 1
            node.parent = parent
            prev, nxt = old.prev_sibling, old.next_sibling
            node.prev_sibling = prev
            node.next_sibling = nxt
            if prev is None:
                parent.first_child = node
            else:
                prev.next_sibling = node
            if nxt is not None:
                nxt.prev_sibling = node
            old.prev_sibling = old.next_sibling = None
        child = node.first_child = old.first_child
        old.first_child = None
        while child is not None:
            child.parent = node
            child = child.next_sibling
        old.flags |= _DETACHED
        return node

    def _index(self, session: str, node: SessionNode) -> None:
        """Index ``node`` under ``session``, keeping the index out of the cyclic garbage
        collector (:func:`_uncollected`): the insert tracks it again, and a full collection
        would then walk all of it (11-28 ms at a million sessions, every stream stalled)."""
        nodes = self._nodes
        nodes[session] = node
        _uncollected(nodes)

    def _known_or_placeholder(self, session: str, deployment: str, now: float) -> SessionNode:
        node = self._nodes.get(session)
        if node is None:
            node = SessionNode(session, deployment, now, _PLACEHOLDER)
            self._index(session, node)
            self._live += 1
            self._trees += 1
        return node

    def _end(self, node: SessionNode, reason: EndReason, now: float) -> SessionEnd:
        """End a live session: counters, tombstone, and release of what only it held."""
        root = self._root_of(node)
        flags = node.flags
        parent = node.parent
        ended = SessionEnd(
            node.session,
            None if parent is None or flags & _HINTED else parent.session,
            root.session,
            node.deployment,
            reason,
            node.turns,
        )
        node.flags = flags | _ENDED
        node.end_reason = reason
        if node.lru_next is not None:
            self._lru_unlink(node)
        root.tree_live -= 1
        root.tree_in_flight -= node.in_flight
        node.in_flight = 0
        self._live -= 1
        self.ended_by_reason[reason] += 1
        if flags & _DETACHED:  # linked nowhere, and its id belongs to a newer session
            kin = self._detached[node.session]
            kin.remove(node)
            if not kin:
                del self._detached[node.session]
            return ended
        if not flags & _CLOSED and not (self._shared and reason in FORGETTING):
            self._tombstone(node.session, now)
        if node.first_child is None:
            self._release(node)
        else:
            self._held_ended += 1
        return ended

    def _release(self, node: SessionNode) -> None:
        """Drop a childless node that is no longer live, then every ancestor that was held only
        for it (placeholders and ended sessions)."""
        nodes = self._nodes
        while True:
            if nodes.get(node.session) is node:
                del nodes[node.session]
            parent = node.parent
            if parent is None:
                # A root points to itself: that loop would keep it alive once it leaves the tree
                # (compiled, nothing else would ever free it; see SessionNode.__init__).
                node.root = _RELEASED
                self._trees -= 1
                return
            prev, nxt = node.prev_sibling, node.next_sibling
            if prev is None:
                parent.first_child = nxt
            else:
                prev.next_sibling = nxt
            if nxt is not None:
                nxt.prev_sibling = prev
            node.parent = node.prev_sibling = node.next_sibling = None
            pflags = parent.flags
            if parent.first_child is not None or not pflags & _DONE:
                return
            if pflags & _PLACEHOLDER:
                self._live -= 1
                self._root_of(parent).tree_live -= 1
            else:
                self._held_ended -= 1
            node = parent

    def _crowded(self) -> bool:
        """Ended sessions held only as ancestors of live ones fill half the cap: a new session's
        lineage is ignored (it starts a tree of its own) until they go. Without this, a chain of
        parents longer than the cap keeps every link (evicting one with a child frees nothing)
        and its growth evicts every other session."""
        if not self._crowding():
            return False
        self.lineage_dropped += 1
        if self.lineage_dropped == 1:
            log.warning(
                "ancestors held for live sessions fill half of sessions.max_live_sessions: new "
                "sessions' parents are ignored until they end (counted in sidecar_lineage_dropped_total)"
            )
        return True

    def _crowding(self) -> bool:
        """Ended sessions held only as ancestors of live ones fill half the cap (no count)."""
        return self._held_ended * 2 > self._max_live

    def _evict(self, now: float) -> list[SessionEnd]:
        evicted: list[SessionEnd] = []
        lru = self._lru
        while self._live + self._held_ended > self._max_live:
            victim = lru.lru_next
            assert victim is not None
            if victim is lru:  # everything live is in flight: exceed the cap until requests finish
                break
            evicted.append(self._end(victim, EndReason.EVICTED, now))
            self.evictions += 1
        return evicted

    def _tombstone(self, session: str, now: float) -> None:
        tombs = self._tombs
        tombs.pop(session, None)
        tombs[session] = now
        if len(tombs) > self._tombstone_max:
            tombs.popitem(last=False)

    def _root_of(self, node: SessionNode) -> SessionNode:
        """The root node of ``node``'s tree, compressing the path to it."""
        root = node.root
        if root.root is root:
            return root
        while root.root is not root:
            root = root.root
        while node.root is not root:
            node.root, node = root, node.root
        return root

    def _root_conflict(self, session: str, hint: str, root: str) -> None:
        self.root_conflicts += 1
        # Session ids are logged only at debug level; the warning says that it happened, once.
        log.debug("root hint %s of session %s contradicts derived root %s; kept %s", hint, session, root, root)
        if not self._conflict_logged:
            self._conflict_logged = True
            log.warning(
                "a client's root-session header contradicts the derived root; the derived root is "
                "kept (counted in sidecar_root_conflicts_total; ids at debug level)"
            )

    @staticmethod
    def _link_child(parent: SessionNode, child: SessionNode) -> None:
        first = parent.first_child
        child.parent = parent
        child.next_sibling = first
        if first is not None:
            first.prev_sibling = child
        parent.first_child = child

    @staticmethod
    def _lru_unlink(node: SessionNode) -> None:
        prev, nxt = node.lru_prev, node.lru_next
        assert prev is not None and nxt is not None
        prev.lru_next = nxt
        nxt.lru_prev = prev
        node.lru_prev = node.lru_next = None

    def _as_dict(self, node: SessionNode) -> dict[str, Any]:
        flags = node.flags
        parent = node.parent
        ended = bool(flags & _ENDED)
        return {
            "session": node.session,
            "parent": None if parent is None or flags & _HINTED else parent.session,
            "root": self._root_of(node).session,
            "deployment": node.deployment,
            "created_at": node.created_at,
            "last_active_at": node.last_active_at,
            "turns": node.turns,
            "in_flight": node.in_flight,
            "final_turn_seen": bool(flags & _FINAL_SEEN),
            "ended": ended,
            "end_reason": node.end_reason.value if ended and node.end_reason is not None else None,
            "closed": bool(flags & _CLOSED),
            "placeholder": bool(flags & _PLACEHOLDER),
            "workers": _runs(node.workers),
            "affinity": {
                "first": 1 if node.worker_turns else 0,
                "same_worker": max(node.worker_turns - 1 - node.moves, 0),
                "moved": node.moves,
            },
            "prompt_cache": prompt_cache(node.prompt_tokens, node.cached_tokens, node.usage_turns, node.unknown_turns),
        }


def subtree_totals(
    top: dict[str, Any], cut: dict[int, list[int]] | None = None, *, step: int = VIEW_STEP
) -> Generator[None, None, None]:
    """Give every node dict of a built view (``top`` and its ``children``, recursively) its
    ``subtree_prompt_cache``: its own ``prompt_cache``, its shown descendants', and the sums in
    ``cut`` (by ``id`` of the dict: the sessions the view cut below it, counted in it). A view
    builder like :meth:`SessionTree.view`; touches each dict twice."""
    order = []  # parents before their children
    stack = [top]
    countdown = step
    while stack:
        d = stack.pop()
        order.append(d)
        stack.extend(d["children"])
        countdown -= 1
        if not countdown:
            countdown = step
            yield
    sums: dict[int, list[int]] = {}
    for d in reversed(order):
        own = d["prompt_cache"]
        acc = [own["prompt_tokens"], own["cached_tokens"], own["reported_turns"], own["unknown_turns"]]
        for extra in [cut.get(id(d)) if cut else None, *(sums.pop(id(c)) for c in d["children"])]:
            if extra is not None:
                for i in range(4):
                    acc[i] += extra[i]
        sums[id(d)] = acc
        d["subtree_prompt_cache"] = prompt_cache(*acc)
        countdown -= 1
        if not countdown:
            countdown = step
            yield


def prompt_cache(prompt_tokens: int, cached_tokens: int, usage_turns: int, unknown_turns: int) -> dict[str, Any]:
    """Prompt-cache accounting as the views show it, for a session or a tree: the prompt and
    cached prompt tokens the responses reported, their ratio (None before any), the turns whose
    response reported them and those whose response said nothing usable."""
    return {
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "cached_ratio": cached_tokens / prompt_tokens if prompt_tokens else None,
        "reported_turns": usage_turns,
        "unknown_turns": unknown_turns,
    }


def unknown_node(session: str, root: str) -> dict[str, Any]:
    """The node dict of an id a view names but holds nothing of (the root of sessions whose
    root's own record is gone: expired from a shared store, or an API session forgotten): a
    placeholder without deployment or times."""
    return {
        "session": session,
        "parent": None,
        "root": root,
        "deployment": None,
        "created_at": None,
        "last_active_at": None,
        "turns": 0,
        "in_flight": 0,
        "final_turn_seen": False,
        "ended": False,
        "end_reason": None,
        "closed": False,
        "placeholder": True,
        "workers": [],
        "affinity": {"first": 0, "same_worker": 0, "moved": 0},
        "prompt_cache": prompt_cache(0, 0, 0, 0),
    }


def _runs(flat: list[str | int] | None) -> list[dict[str, Any]]:
    if not flat:
        return []
    return [{"worker": flat[i], "turns": flat[i + 1]} for i in range(0, len(flat), 2)]
