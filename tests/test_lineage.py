"""The session lineage tree on hand-built inputs, with a hand-driven clock."""

from __future__ import annotations

import itertools
import logging

import pytest

from sidecar.context import EndReason, RoutingContext, SessionEnd, TurnOutcome
from sidecar.lineage import VIEW_STEP, SessionTree, Turn, exhaust

COMPLETED = TurnOutcome.COMPLETED
FAILED = TurnOutcome.UPSTREAM_FAILED
ABORTED = TurnOutcome.CLIENT_ABORTED
# lineage's _ENDED flag bit (compiled, a C constant the module does not export).
_ENDED_FLAG = 8


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """Drives one tree and keeps every SessionEnd it returned, to check exactly-once ends."""

    def __init__(self, **kwargs: float) -> None:
        self.clock = Clock()
        self.tree = SessionTree(clock=self.clock, **kwargs)  # type: ignore[arg-type]
        self.ended: list[SessionEnd] = []

    def begin(
        self,
        session: str,
        parent: str | None = None,
        *,
        final: bool = False,
        root_hint: str | None = None,
        deployment: str = "dep",
    ) -> Turn:
        turn, evicted = self.tree.begin(session, parent=parent, root_hint=root_hint, final=final, deployment=deployment)
        self.ended += evicted
        return turn

    def end(self, turn: Turn, outcome: TurnOutcome = COMPLETED) -> list[SessionEnd]:
        ended = self.tree.finish(turn, outcome)
        self.ended += ended
        return ended

    def turn(
        self,
        session: str,
        parent: str | None = None,
        *,
        final: bool = False,
        root_hint: str | None = None,
        outcome: TurnOutcome = COMPLETED,
    ) -> RoutingContext:
        """One whole request: begin, then end."""
        turn = self.begin(session, parent, final=final, root_hint=root_hint)
        self.end(turn, outcome)
        return turn.ctx

    def close(self, session: str) -> list[SessionEnd]:
        ended = self.tree.close(session)
        self.ended += ended
        return ended

    def expire(self, limit: int = 1 << 62) -> list[SessionEnd]:
        ended, _ = self.tree.expire(limit)
        self.ended += ended
        return ended

    def shutdown(self) -> list[SessionEnd]:
        ended = self.tree.shutdown()
        self.ended += ended
        return ended

    def reasons(self) -> dict[str, EndReason]:
        """session id -> reason; fails if an id ended twice (for tests that never reuse an id)."""
        sessions = [e.session for e in self.ended]
        assert len(sessions) == len(set(sessions)), f"ended more than once: {sessions}"
        return {e.session: e.reason for e in self.ended}


def tree_size(node: dict | None) -> int:
    if node is None:
        return 0
    return 1 + sum(tree_size(c) for c in node["children"])


def walk(view: dict | None) -> list[dict]:
    """Node dicts of a nested view, any order."""
    out, stack = [], [view] if view is not None else []
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node["children"])
    return out


# -- finality ----------------------------------------------------------------------------------


def test_lone_session_turns_and_final() -> None:
    h = Harness()
    first = h.turn("s")
    assert first == RoutingContext(
        session="s",
        parent=None,
        root="s",
        is_final_turn=False,
        is_parent_final=None,
        is_tree_final=False,
        turn=1,
        deployment="dep",
    )
    assert h.turn("s").turn == 2
    turn = h.begin("s", final=True)
    assert turn.ctx == RoutingContext(
        session="s",
        parent=None,
        root="s",
        is_final_turn=True,
        is_parent_final=None,
        is_tree_final=True,
        turn=3,
        deployment="dep",
    )
    assert h.end(turn) == [SessionEnd("s", None, "s", "dep", EndReason.FINAL_TURN_COMPLETED, 3)]
    assert h.tree.live_sessions == 0 and h.tree.live_trees == 0
    assert h.tree.get("s") is None and h.tree.is_closed("s")


@pytest.mark.parametrize("order", list(itertools.permutations(["r", "a", "b", "g"])))
def test_tree_final_only_on_last_final_turn(order: tuple[str, ...]) -> None:
    parents = {"r": None, "a": "r", "b": "r", "g": "a"}
    h = Harness()
    for session in ("r", "a", "b", "g"):
        h.turn(session, parents[session])
    done: set[str] = set()
    for i, session in enumerate(order):
        facts = h.turn(session, parents[session], final=True)
        done.add(session)
        assert facts.is_tree_final is (i == len(order) - 1), (order, session)
        assert facts.root == "r"
        parent = parents[session]
        assert facts.is_parent_final is (None if parent is None else parent in done)
    assert h.reasons() == dict.fromkeys("rabg", EndReason.FINAL_TURN_COMPLETED)
    assert h.tree.live_sessions == 0 and h.tree.live_trees == 0 and h.tree.tree("r") is None


def test_ended_parent_stays_in_tree_while_children_live() -> None:
    h = Harness()
    h.turn("r")
    h.turn("c", "r")
    h.turn("r", final=True)
    assert h.reasons() == {"r": EndReason.FINAL_TURN_COMPLETED}
    view = h.tree.tree("r")
    assert view is not None
    assert (view["session"], view["ended"], view["end_reason"]) == ("r", True, "final_turn_completed")
    assert [c["session"] for c in view["children"]] == ["c"]
    assert h.tree.live_sessions == 1 and h.tree.live_trees == 1
    facts = h.turn("c", "r", final=True)
    assert facts.is_parent_final is True and facts.is_tree_final is True
    assert h.tree.get("r") is None and h.tree.live_trees == 0


def test_new_descendant_reopens_a_tree() -> None:
    h = Harness()
    h.turn("r")
    h.turn("c", "r", final=True)  # the tree is down to r alone
    h.turn("d", "r")  # a new child arrives after that
    assert h.turn("r", final=True).is_tree_final is False
    assert h.turn("d", "r", final=True).is_tree_final is True


def test_child_spawned_by_an_in_flight_tree_final_turn() -> None:
    h = Harness()
    h.turn("r")
    root_final = h.begin("r", final=True)
    assert root_final.ctx.is_tree_final is True
    child = h.turn("d", "r")  # spawned while the root's final turn is still streaming
    assert child.is_parent_final is True and child.is_tree_final is False
    h.end(root_final)
    assert h.turn("d", "r", final=True).is_tree_final is True


def test_unknown_parent_becomes_a_placeholder() -> None:
    h = Harness()
    facts = h.turn("c", "p")
    assert (facts.parent, facts.root, facts.is_parent_final) == ("p", "p", None)
    node = h.tree.get("p")
    assert node is not None and node["placeholder"] is True and node["turns"] == 0
    assert h.tree.live_sessions == 2 and h.tree.live_trees == 1
    assert h.close("p") == [] and not h.tree.is_closed("p")  # a placeholder is no session yet
    # the unknown parent could still be live: never tree-final while it is a placeholder
    assert h.turn("c", "p", final=True).is_tree_final is False
    assert h.reasons() == {"c": EndReason.FINAL_TURN_COMPLETED}  # the placeholder ends silently
    assert h.tree.get("p") is None and h.tree.live_sessions == 0 and h.tree.live_trees == 0


def test_placeholder_promoted_by_its_own_request_joins_its_parents_tree() -> None:
    h = Harness()
    h.turn("g")
    h.turn("c", "p")
    assert h.tree.live_trees == 2
    facts = h.turn("p", "g")  # p's own first request names its parent
    assert (facts.turn, facts.root, facts.is_parent_final) == (1, "g", False)
    assert h.tree.get("p")["placeholder"] is False  # type: ignore[index]
    assert h.tree.live_trees == 1
    child = h.turn("c", "p")
    assert (child.root, child.is_parent_final) == ("g", False)
    view = h.tree.tree("g")
    assert view is not None and tree_size(view) == 3
    assert view["children"][0]["children"][0]["session"] == "c"


def test_placeholder_naming_its_descendant_as_parent_is_ignored() -> None:
    h = Harness()
    h.turn("c", "p")
    facts = h.turn("p", "c")  # would close a cycle p -> c -> p
    assert (facts.parent, facts.root) == (None, "p")
    assert tree_size(h.tree.tree("c")) == 2
    h.shutdown()
    assert h.reasons() == {"c": EndReason.SHUTDOWN, "p": EndReason.SHUTDOWN}
    assert h.tree.live_sessions == 0 and h.tree.live_trees == 0


def test_concurrent_turns_of_one_session() -> None:
    h = Harness()
    first = h.begin("s")
    final = h.begin("s", final=True)
    assert (first.ctx.turn, final.ctx.turn) == (1, 2)
    assert final.ctx.is_tree_final is False  # another request of the tree is in flight
    assert h.tree.get("s")["in_flight"] == 2  # type: ignore[index]
    assert h.end(final) == []  # the session ends only when nothing of it is in flight
    assert h.tree.get("s")["ended"] is False  # type: ignore[index]
    assert h.end(first) == [SessionEnd("s", None, "s", "dep", EndReason.FINAL_TURN_COMPLETED, 2)]
    assert h.end(first) == [] and h.end(final) == []


# -- end of session, one test per reason ---------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "reason"),
    [
        (COMPLETED, EndReason.FINAL_TURN_COMPLETED),
        (FAILED, EndReason.FINAL_TURN_FAILED),
        (ABORTED, EndReason.CLIENT_ABANDONED),
    ],
)
def test_final_turn_outcome_sets_the_reason(outcome: TurnOutcome, reason: EndReason) -> None:
    h = Harness()
    h.turn("r")
    h.turn("c", "r", outcome=ABORTED)  # a non-final turn ends nothing, whatever its outcome
    assert h.ended == []
    h.turn("c", "r", final=True, outcome=outcome)
    assert h.ended == [SessionEnd("c", "r", "r", "dep", reason, 2)]
    assert h.tree.ended_by_reason[reason] == 1


def test_api_close_of_an_idle_session() -> None:
    h = Harness()
    h.turn("r")
    h.turn("c", "r")
    assert h.close("c") == [SessionEnd("c", "r", "r", "dep", EndReason.API_CLOSED, 1)]
    assert h.tree.is_closed("c")
    assert h.close("c") == [] and h.close("unknown") == []
    assert h.turn("r").is_tree_final is False and h.tree.tree("r")["children"] == []  # type: ignore[index]


def test_api_close_in_flight_is_reported_by_finish() -> None:
    h = Harness()
    turn = h.begin("s")
    assert h.close("s") == []
    assert h.tree.is_closed("s")  # closed at once
    assert h.close("s") == []  # closing again changes nothing
    assert h.end(turn) == [SessionEnd("s", None, "s", "dep", EndReason.API_CLOSED, 1)]
    assert h.reasons() == {"s": EndReason.API_CLOSED}


def test_request_on_a_closed_session_still_draining_starts_a_new_one() -> None:
    h = Harness()
    old = h.begin("s")
    h.close("s")
    new = h.begin("s")
    assert new.ctx.turn == 1 and h.tree.tombstone_reuses == 1
    assert not h.tree.is_closed("s")
    assert h.end(old) == [SessionEnd("s", None, "s", "dep", EndReason.API_CLOSED, 1)]
    assert h.tree.get("s")["in_flight"] == 1  # type: ignore[index]  # the new session is untouched
    assert h.end(new) == []
    assert h.tree.live_sessions == 1


def test_close_with_a_reason() -> None:
    h = Harness()
    h.turn("s")
    assert h.tree.close("s", EndReason.IDLE_EXPIRED) == [SessionEnd("s", None, "s", "dep", EndReason.IDLE_EXPIRED, 1)]


def test_bound_deployment() -> None:
    h = Harness()
    h.turn("s")
    h.turn("c", "p")
    assert h.tree.bound_deployment("s") == "dep"
    assert h.tree.bound_deployment("p") is None  # a placeholder is bound to nothing yet
    h.close("s")
    assert h.tree.bound_deployment("s") is None and h.tree.bound_deployment("unknown") is None


def test_close_after_final_turn_finished_keeps_the_final_reason() -> None:
    h = Harness()
    other = h.begin("s")
    h.end(h.begin("s", final=True))
    assert h.close("s") == []
    assert h.end(other) == [SessionEnd("s", None, "s", "dep", EndReason.FINAL_TURN_COMPLETED, 2)]


def test_idle_expiry() -> None:
    h = Harness(idle_ttl=60.0)
    h.turn("old")
    h.clock.now += 30
    h.turn("young")
    busy = h.begin("busy")
    h.clock.now += 29.9
    assert h.expire() == []
    h.clock.now += 0.1
    assert h.expire() == [SessionEnd("old", None, "old", "dep", EndReason.IDLE_EXPIRED, 1)]
    h.clock.now += 1000  # a request in flight keeps its session alive however long it takes
    assert [e.session for e in h.expire()] == ["young"]
    h.end(busy)  # idle from now on
    h.clock.now += 59
    h.turn("fresh")
    h.clock.now += 1
    assert [e.session for e in h.expire()] == ["busy"]
    assert h.reasons() == dict.fromkeys(["old", "young", "busy"], EndReason.IDLE_EXPIRED)
    assert h.tree.live_sessions == 1


def test_expiry_follows_last_activity_not_creation() -> None:
    h = Harness(idle_ttl=10.0)
    for s in ("a", "b", "c"):
        h.turn(s)
        h.clock.now += 1
    h.turn("a")  # a becomes the most recently active
    h.clock.now += 9
    assert [e.session for e in h.expire()] == ["b", "c"]
    h.clock.now += 2
    assert [e.session for e in h.expire()] == ["a"]


def test_expiry_releases_placeholders_and_ended_ancestors() -> None:
    h = Harness(idle_ttl=10.0)
    h.turn("c", "p")
    h.turn("r")
    h.turn("k", "r")
    h.turn("r", final=True)
    h.clock.now += 10
    assert sorted(e.session for e in h.expire()) == ["c", "k"]
    assert h.tree.live_sessions == 0 and h.tree.live_trees == 0
    assert h.tree.get("p") is None and h.tree.get("r") is None


def test_eviction_at_the_cap_takes_the_least_recently_active_idle_session() -> None:
    h = Harness(max_live=3)
    h.turn("a")
    busy = h.begin("b")
    h.turn("c")
    h.turn("a")  # c is now the least recently active idle session; b is in flight
    h.turn("d")
    assert h.reasons() == {"c": EndReason.EVICTED}
    assert h.tree.evictions == 1 and h.tree.live_sessions == 3
    h.end(busy)
    h.turn("e")
    assert h.reasons()["a"] is EndReason.EVICTED


def test_eviction_never_takes_in_flight_sessions() -> None:
    h = Harness(max_live=2)
    turns = [h.begin(s) for s in "abc"]
    assert h.ended == [] and h.tree.live_sessions == 3  # cap exceeded while all are in flight
    h.end(turns[0])
    h.turn("d")
    assert h.reasons() == {"a": EndReason.EVICTED}


def test_shutdown_ends_in_flight_sessions_whose_turns_then_end_quietly() -> None:
    h = Harness()
    idle = h.turn("a")
    busy = h.begin("b")
    ended = h.shutdown()
    assert sorted(e.session for e in ended) == ["a", "b"]
    assert h.reasons() == {"a": EndReason.SHUTDOWN, "b": EndReason.SHUTDOWN}
    assert h.end(busy) == []  # already ended: its end hook ran once, at shutdown
    assert idle.turn == 1 and h.tree.live_sessions == 0 and h.tree.live_trees == 0


def test_shutdown_ends_every_live_session_once() -> None:
    h = Harness()
    h.turn("r")
    h.turn("c", "r")
    h.turn("g", "c")
    h.turn("x", "unknown-parent")
    h.turn("c", "r", final=True)  # c ended, held for g
    draining = h.begin("z")
    h.close("z")
    h.begin("z")  # a new z while the closed one drains
    h.shutdown()
    assert [(e.session, e.reason) for e in h.ended[:1]] == [("c", EndReason.FINAL_TURN_COMPLETED)]
    # both z sessions end, the closed one and the new one
    assert sorted(e.session for e in h.ended[1:]) == ["g", "r", "x", "z", "z"]
    assert {e.reason for e in h.ended[1:]} == {EndReason.SHUTDOWN}
    assert h.end(draining) == []
    assert h.tree.live_sessions == 0 and h.tree.live_trees == 0 and h.tree.get("unknown-parent") is None


# -- a held node's id reused -------------------------------------------------------------------


def ids(view: dict | None) -> list[str]:
    """Session ids of a nested view, depth first, oldest child first."""
    out, stack = [], [view] if view is not None else []
    while stack:
        node = stack.pop()
        out.append(node["session"])
        stack.extend(reversed(node["children"]))
    return out


def test_reused_id_of_an_ended_ancestor_takes_its_place() -> None:
    h = Harness(max_live=3)
    h.turn("r")
    h.turn("c", "r")
    h.turn("r", final=True)  # r ends, held for c
    facts = h.turn("r", "elsewhere")  # a new r: its declared parent is ignored
    assert (facts.turn, facts.parent, facts.root) == (1, None, "r") and h.tree.tombstone_reuses == 1
    assert h.tree.get("elsewhere") is None  # no placeholder for the ignored parent
    view = h.tree.tree("c")
    assert ids(view) == ["r", "c"] and view is not None
    assert (view["turns"], view["ended"], view["end_reason"], view["final_turn_seen"]) == (1, False, None, False)
    assert h.tree.live_sessions == 2 and h.tree.live_trees == 1
    assert h.tree.bound_deployment("r") == "dep"
    # the new r is live again: its child's parent is not final, the tree is not final without it
    assert h.turn("c", "r").is_parent_final is False
    # r is counted once against the cap (live, no longer held as ended): room for one more
    h.turn("x")
    assert h.ended == [SessionEnd("r", None, "r", "dep", EndReason.FINAL_TURN_COMPLETED, 2)]
    assert h.turn("r", final=True).is_tree_final is False  # the new r ends, held for c again
    assert ids(h.tree.tree("r")) == ["r", "c"] and h.tree.get("r")["ended"] is True  # type: ignore[index]
    assert h.turn("c", "r", final=True).is_tree_final is True
    assert [(e.session, e.turns) for e in h.ended] == [("r", 2), ("r", 2), ("c", 3)]
    assert h.tree.get("r") is None and h.tree.get("c") is None
    assert h.tree.live_sessions == 1 and h.tree.live_trees == 1  # x


def test_reused_id_of_an_ended_inner_node_takes_its_place() -> None:
    h = Harness()
    h.turn("r")
    h.turn("s", "r")
    h.turn("g", "s")
    h.turn("s", "r", final=True)  # s ends, held for g
    facts = h.turn("s")  # a new s, naming no parent: it stays under r
    assert (facts.turn, facts.parent, facts.root, facts.is_parent_final) == (1, "r", "r", False)
    assert ids(h.tree.tree("r")) == ["r", "s", "g"]
    assert h.turn("g", "s").is_parent_final is False
    assert h.tree.live_sessions == 3 and h.tree.live_trees == 1
    h.shutdown()
    assert sorted(e.session for e in h.ended) == ["g", "r", "s", "s"]
    assert h.tree.live_sessions == 0 and h.tree.live_trees == 0


def test_reused_id_of_a_closed_root_still_draining_takes_its_place() -> None:
    h = Harness()
    old = h.begin("r")
    h.turn("c", "r")
    assert h.close("r") == []  # draining
    new = h.begin("r", "elsewhere")
    assert (new.ctx.turn, new.ctx.parent, new.ctx.root) == (1, None, "r")
    assert h.tree.get("elsewhere") is None and h.tree.tombstone_reuses == 1
    view = h.tree.tree("c")
    assert ids(view) == ["r", "c"] and view is not None
    assert (view["in_flight"], view["closed"], view["turns"]) == (1, False, 1)  # the new r
    assert h.tree.live_sessions == 3 and h.tree.live_trees == 1  # old r, new r, c
    assert h.turn("c", "r").is_parent_final is False
    # the old r drains alone and ends once, with its own facts
    assert h.end(old) == [SessionEnd("r", None, "r", "dep", EndReason.API_CLOSED, 1)]
    assert h.end(old) == []
    assert h.tree.live_sessions == 2 and h.tree.live_trees == 1 and ids(h.tree.tree("r")) == ["r", "c"]
    assert h.tree.get("r")["in_flight"] == 1  # type: ignore[index]
    h.end(new)
    assert h.turn("c", "r", final=True).is_tree_final is False  # the new r is live
    assert h.turn("r", final=True).is_tree_final is True
    assert [e.session for e in h.ended] == ["r", "c", "r"]
    assert h.tree.live_sessions == 0 and h.tree.live_trees == 0 and h.tree.get("r") is None


def test_a_draining_session_counts_in_its_tree_until_it_ends() -> None:
    h = Harness()
    old = h.begin("r")
    h.close("r")
    h.begin("r", final=True)  # a new r: alone in the tree but for the old r, still draining
    assert h.tree.live_trees == 1 and h.tree.live_sessions == 2
    final = h.begin("r", final=True)
    assert final.ctx.is_tree_final is False
    h.end(old)
    assert h.turn("r", final=True).is_tree_final is False  # the new r's first turn is in flight
    h.shutdown()
    assert [e.session for e in h.ended] == ["r", "r"]
    assert h.end(final) == [] and h.tree.live_sessions == 0 and h.tree.live_trees == 0


def test_reused_id_of_a_closed_inner_node_still_draining_takes_its_place() -> None:
    h = Harness()
    h.turn("p")
    h.turn("a", "p")
    old = h.begin("s", "p")
    h.turn("b", "p")
    h.turn("g1", "s")
    h.turn("g2", "s")
    h.close("s")
    h.turn("s")  # takes the old s's place among p's children, with its children
    assert ids(h.tree.tree("p")) == ["p", "a", "s", "g1", "g2", "b"]
    assert h.turn("g1", "s").is_parent_final is False
    assert h.end(old) == [SessionEnd("s", "p", "p", "dep", EndReason.API_CLOSED, 1)]
    assert ids(h.tree.tree("p")) == ["p", "a", "s", "g1", "g2", "b"]
    assert h.tree.live_sessions == 6 and h.tree.live_trees == 1
    for s, parent in (("a", "p"), ("b", "p"), ("g1", "s"), ("g2", "s"), ("p", None)):
        h.turn(s, parent, final=True)
    assert h.turn("s", final=True).is_tree_final is True
    assert h.tree.live_sessions == 0 and h.tree.live_trees == 0


def test_shutdown_ends_a_detached_draining_session_once() -> None:
    h = Harness()
    old = h.begin("r")
    h.turn("c", "r")
    h.close("r")
    h.turn("r")
    h.shutdown()
    assert sorted((e.session, e.turns) for e in h.ended) == [("c", 1), ("r", 1), ("r", 1)]
    assert h.end(old) == [] and h.tree.live_sessions == 0 and h.tree.live_trees == 0


def test_in_flight_of_an_id_counts_closed_sessions_still_draining_under_it() -> None:
    # What a replica reports to the shared store as its requests of an id in flight: the newest
    # session's and those of closed sessions of the id whose place it took.
    h = Harness()
    first = h.begin("s")
    h.close("s")
    second = h.begin("s")  # takes the id over; the first drains detached
    third = h.begin("s")
    assert h.tree.in_flight_of("s") == 3
    h.close("s")
    fourth = h.begin("s")  # a second take-over while the first still drains
    assert h.tree.in_flight_of("s") == 4 and h.tree.node_of("s") is fourth.node
    h.end(second)
    h.end(first)
    assert h.tree.in_flight_of("s") == 2
    h.end(third)
    assert h.tree.in_flight_of("s") == 1 and h.tree._detached == {}
    h.end(fourth)
    assert h.tree.in_flight_of("s") == 0 and h.tree.in_flight_of("unknown") == 0
    assert [(e.session, e.turns) for e in h.ended] == [("s", 1), ("s", 2)]  # the two closed ones
    assert h.tree.get("s")["ended"] is False  # the newest lives on
    check_counters(h.tree)


def check_counters(tree: SessionTree) -> None:
    """White-box: the tree's counters are what its nodes say (one linked node per id, each live
    session, placeholder and draining detached session counted in its tree, each held ended node
    once)."""

    def top(node):  # no path compression: only look
        while node.root is not node:
            node = node.root
        return node

    live = held = 0
    per_root: dict[int, list[int]] = {}
    roots = [n for n in tree._nodes.values() if n.parent is None]
    assert all(top(n) is n for n in roots) and tree._trees == len(roots)
    members = [node for kin in tree._detached.values() for node in kin]
    for node in tree._nodes.values():
        if node.parent is not None:
            sibling = node.parent.first_child
            while sibling is not None and sibling is not node:
                sibling = sibling.next_sibling
            assert sibling is node, f"{node.session} is not among its parent's children"
        if node.flags & _ENDED_FLAG:
            assert node.first_child is not None and node.in_flight == 0
            held += 1
        else:
            members.append(node)
    for node in members:
        assert not node.flags & _ENDED_FLAG
        live += 1
        counts = per_root.setdefault(id(top(node)), [0, 0])
        counts[0] += 1
        counts[1] += node.in_flight
    assert (tree._live, tree._held_ended) == (live, held)
    for root in roots:
        assert [root.tree_live, root.tree_in_flight] == per_root.get(id(root), [0, 0]), root.session


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_every_live_session_reachable_and_ends_each_once(seed: int) -> None:
    """Random requests, finals, closes, expiry and eviction over a few reused ids. After every step:
    each live session's id is reachable from its tree's root id, the counters match what the
    views show, and every session (an id's first turn starts one) ends at most once; at
    shutdown, all."""
    import random

    rng = random.Random(seed)
    pool = [f"s{i}" for i in range(7)]
    h = Harness(max_live=6, idle_ttl=50.0)
    open_turns: list[Turn] = []
    live: dict[str, int] = {}  # id -> sessions of that id not ended yet

    def account() -> None:
        for e in h.ended:
            live[e.session] -= 1
            assert live[e.session] >= 0, f"{e.session} ended more often than it started"
        h.ended.clear()

    for _ in range(400):
        op = rng.random()
        if op < 0.5 or not open_turns:
            session = rng.choice(pool)
            parent = rng.choice([None, *pool])
            turn = h.begin(session, parent, final=rng.random() < 0.25)
            if turn.ctx.turn == 1:
                live[session] = live.get(session, 0) + 1
            open_turns.append(turn)
        elif op < 0.85:
            h.end(open_turns.pop(rng.randrange(len(open_turns))), rng.choice(list(TurnOutcome)))
        elif op < 0.95:
            h.close(rng.choice(pool))
        else:
            h.clock.now += 30
            h.expire()
        account()
        check_counters(h.tree)
        roots = exhaust(h.tree.recent_roots(1000))
        assert len(roots) == len(set(roots)) == h.tree.live_trees
        views = [h.tree.tree(r) for r in roots]
        shown = [n for v in views for n in walk(v)]
        placeholders = sum(1 for n in shown if n["placeholder"])
        assert h.tree.live_sessions == sum(live.values()) + placeholders
        for session, count in live.items():
            if not count:
                continue
            root = h.tree.root_of(session)
            if root is None:  # only a closed session still draining, whose successor left, is linked nowhere
                assert any(t.ctx.session == session for t in open_turns), session
            else:
                assert session in ids(h.tree.tree(root)), session
    h.shutdown()
    account()
    assert not any(live.values()) and h.tree.live_sessions == 0 and h.tree.live_trees == 0


# -- tombstones ----------------------------------------------------------------------------------


def test_tombstone_reuse_starts_a_new_session() -> None:
    h = Harness()
    h.turn("s")
    h.turn("s", final=True)
    assert h.tree.is_closed("s")
    facts = h.turn("s")
    assert facts.turn == 1 and h.tree.tombstone_reuses == 1
    assert not h.tree.is_closed("s") and h.tree.get("s")["turns"] == 1  # type: ignore[index]


def test_tombstones_bounded_by_count() -> None:
    h = Harness(tombstone_max=2)
    for s in "abc":
        h.turn(s, final=True)
    assert [h.tree.is_closed(s) for s in "abc"] == [False, True, True]
    assert h.tree.tombstones == 2
    h.turn("a")  # forgotten: a plain new session
    assert h.tree.tombstone_reuses == 0


def test_tombstones_bounded_by_age() -> None:
    h = Harness(tombstone_ttl=10.0)
    h.turn("a", final=True)
    h.clock.now += 5
    h.turn("b", final=True)
    h.clock.now += 5
    h.expire()
    assert not h.tree.is_closed("a") and h.tree.is_closed("b")
    h.clock.now += 5
    h.expire()
    assert h.tree.tombstones == 0


def test_ended_parents_held_for_live_children_count_against_the_cap() -> None:
    h = Harness(max_live=10)
    h.turn("s0")
    for i in range(1, 100):  # a chain where each session ends once its child exists
        h.turn(f"s{i}", f"s{i - 1}")
        h.end(h.begin(f"s{i - 1}", final=True))
        assert tree_size(h.tree.tree(f"s{i}")) <= 10
        assert h.tree.live_sessions + h.tree.held_ancestors <= 10
    # held ancestors filled half the cap: later links started trees of their own
    assert h.tree.lineage_dropped > 0
    assert h.tree.live_sessions == 1


def test_deep_chain_does_not_hit_the_recursion_limit() -> None:
    h = Harness()
    h.turn("s0")
    for i in range(1, 5000):
        h.turn(f"s{i}", f"s{i - 1}")
    assert h.turn("s4999", "s4998").root == "s0"
    view = h.tree.tree("s0")
    depth = 0
    while view is not None and view["children"]:
        view = view["children"][0]
        depth += 1
    assert depth == 4999
    assert len(h.shutdown()) == 5000 and h.tree.live_trees == 0


# -- root hints ----------------------------------------------------------------------------------


def test_root_hint_conflict_is_counted_once_and_the_derived_root_kept(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    h.turn("r")
    with caplog.at_level(logging.WARNING, logger="sidecar.lineage"):
        facts = h.turn("c", "r", root_hint="elsewhere")
        again = h.turn("c", "r", root_hint="elsewhere")
        h.turn("d", "r", root_hint="elsewhere")
    assert facts.root == "r" and again.root == "r"
    assert h.tree.root_conflicts == 2  # c and d, each counted once
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert h.turn("e", "r", root_hint="r").root == "r" and h.tree.root_conflicts == 2


def test_root_hint_of_a_parentless_session_joins_that_tree() -> None:
    h = Harness()
    facts = h.turn("s", root_hint="top")
    assert (facts.parent, facts.root, facts.is_parent_final) == (None, "top", None)
    top = h.tree.tree("top")
    assert top is not None and top["placeholder"] is True
    assert [(c["session"], c["parent"]) for c in top["children"]] == [("s", None)]
    h.turn("top")  # the root shows up: s's tree is the same tree
    assert h.turn("s", root_hint="top", final=True).is_tree_final is False
    assert h.turn("top", final=True).is_tree_final is True
    assert h.tree.root_conflicts == 0


# -- views ---------------------------------------------------------------------------------------


def test_node_dict() -> None:
    h = Harness()
    h.turn("r")
    h.clock.now += 2
    turn = h.begin("c", "r", final=True, deployment="other")
    node = h.tree.get("c")
    assert node is not None
    assert (
        node.items()
        >= {
            "session": "c",
            "parent": "r",
            "root": "r",
            "deployment": "other",
            "created_at": 1002.0,
            "last_active_at": 1002.0,
            "turns": 1,
            "in_flight": 1,
            "final_turn_seen": True,
            "ended": False,
            "end_reason": None,
            "closed": False,
            "placeholder": False,
        }.items()
    )
    view = h.tree.tree("c")  # any member's id gives its whole tree
    assert view is not None and view["session"] == "r" and view["children"][0]["children"] == []
    h.clock.now += 1
    h.end(turn)
    assert h.tree.get("c") is None and h.tree.tree("c") is None
    assert h.tree.get("r")["last_active_at"] == 1000.0  # type: ignore[index]


def test_children_listed_oldest_first() -> None:
    h = Harness()
    h.turn("r")
    for s in "xyz":
        h.turn(s, "r")
    h.turn("y", "r", final=True)
    view = h.tree.tree("r")
    assert view is not None and [c["session"] for c in view["children"]] == ["x", "z"]


def test_view_cuts_depth_and_count_with_omitted_markers() -> None:
    h = Harness()
    h.turn("s0")
    for i in range(1, 20_000):  # one chain, far deeper than any JSON encoder nests
        h.turn(f"s{i}", f"s{i - 1}")
    view = exhaust(h.tree.view("s123", max_depth=48))
    assert view is not None and (view.sessions, view.live, view.shown, view.omitted) == (20_000, 20_000, 49, 19_951)
    chain = walk(view.tree)
    assert [n["session"] for n in chain] == [f"s{i}" for i in range(49)]
    assert chain[-1]["children"] == [] and chain[-1]["omitted"] == 19_951
    assert all("omitted" not in n for n in chain[:-1])
    full = h.tree.tree("s0")
    assert len(walk(full)) == 20_000 and "omitted" not in walk(full)[-1]


def test_view_of_a_100k_session_tree_builds_only_what_it_shows() -> None:
    h = Harness(max_live=200_000)
    h.turn("root")
    for i in range(300):
        h.turn(f"a{i}", "root")
    for i in range(99_699):
        h.turn(f"b{i}", f"a{i % 300}")
    h.turn("a0", "root", final=True)  # ended, held for its children
    view = exhaust(h.tree.view("b5", max_depth=48, max_nodes=2000))
    assert view is not None
    assert (view.sessions, view.live, view.shown, view.omitted) == (100_000, 99_999, 2000, 98_000)
    assert view.final is False and view.in_flight == 0
    top = view.tree
    assert [c["session"] for c in top["children"]] == [f"a{i}" for i in range(300)]  # shallower levels win
    assert "omitted" not in top and top["children"][0]["ended"] is True
    a = top["children"]
    assert [c["session"] for c in a[0]["children"]] == [f"b{i}" for i in range(0, 99_699, 300)]
    # 1999 below the root: the 300 a's, then the b's of the earliest a's (333 each) while they last
    assert [len(x["children"]) for x in a[:7]] == [333, 333, 333, 333, 333, 34, 0]
    assert [x.get("omitted", 0) for x in a[:7]] == [0, 0, 0, 0, 0, 299, 333]
    assert a[-1]["children"] == [] and a[-1]["omitted"] == 332
    nodes = walk(top)
    assert len(nodes) == 2000 and sum(n.get("omitted", 0) for n in nodes) == 98_000


def test_view_pauses_every_few_hundred_nodes() -> None:
    h = Harness(max_live=200_000)
    h.turn("root")
    for i in range(20_000):
        h.turn(f"c{i}", "root")  # one child list: the walk pauses inside it too
    steps = h.tree.view("root", max_nodes=20_001)
    pauses = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            view = done.value
            break
        pauses += 1
    assert view.shown == 20_001 and pauses >= 2 * 20_000 // VIEW_STEP
    roots = h.tree.recent_roots(10)
    pauses = 0
    while True:
        try:
            next(roots)
        except StopIteration as done:
            assert done.value == ["root"]
            break
        pauses += 1
    assert pauses >= 20_000 // VIEW_STEP


def test_long_root_link_chain_of_promoted_placeholders() -> None:
    h = Harness()
    h.turn("c", "p1")
    for i in range(1, 20_000):  # each placeholder's own request names the next one as its parent
        h.turn(f"p{i}", f"p{i + 1}")
    assert h.tree.live_trees == 1 and h.tree.root_of("c") == "p20000"
    assert exhaust(h.tree.recent_roots(5)) == ["p20000"]
    view = exhaust(h.tree.view("c", max_depth=48))
    assert view is not None and (view.sessions, view.shown, view.omitted) == (20_001, 49, 19_952)


@pytest.mark.parametrize("seed", range(4))
def test_views_stay_well_formed_while_the_tree_changes_between_pauses(seed: int) -> None:
    import random

    rng = random.Random(seed)
    h = Harness(max_live=5000, idle_ttl=5.0)
    pool = [f"s{i}" for i in range(3000)]
    for session in pool[:2000]:
        h.turn(session, rng.choice([None, *pool[:50]]))
    open_turns: list[Turn] = []

    def mutate() -> None:
        for _ in range(20):
            op = rng.random()
            if op < 0.5:
                session = rng.choice(pool)
                open_turns.append(h.begin(session, rng.choice([None, *pool[:100]]), final=rng.random() < 0.3))
            elif op < 0.85 and open_turns:
                h.end(open_turns.pop(rng.randrange(len(open_turns))))
            elif op < 0.95:
                h.close(rng.choice(pool))
            else:
                h.clock.now += 3
                h.expire()

    for builder in (
        lambda: h.tree.recent_roots(50),
        lambda: h.tree.view(rng.choice(pool[:50]), max_depth=6, max_nodes=300),
    ):
        for _ in range(10):
            steps = builder()
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    result = done.value
                    break
                mutate()
            if isinstance(result, list):
                assert len(result) == len(set(result)) <= 50
            elif result is not None:
                nodes = walk(result.tree)
                assert len(nodes) == result.shown <= 300
                assert result.omitted == sum(n.get("omitted", 0) for n in nodes)
                assert all(isinstance(n["children"], list) for n in nodes)
    h.shutdown()
    assert h.tree.live_sessions == 0 and h.tree.live_trees == 0


def test_stats() -> None:
    h = Harness()
    h.turn("a")
    h.turn("b", "a")
    h.turn("c")
    assert (h.tree.live_sessions, h.tree.live_trees) == (3, 2)
    h.turn("c", final=True)
    assert (h.tree.live_sessions, h.tree.live_trees) == (2, 1)
    assert h.tree.ended_by_reason == {**dict.fromkeys(EndReason, 0), EndReason.FINAL_TURN_COMPLETED: 1}


@pytest.mark.parametrize("kwargs", [{"idle_ttl": 0}, {"max_live": 0}, {"tombstone_max": -1}, {"tombstone_ttl": -1}])
def test_invalid_limits_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SessionTree(**kwargs)  # type: ignore[arg-type]


def test_expiry_of_a_backlog_runs_in_bounded_batches() -> None:
    h = Harness()
    for i in range(25):
        h.turn(f"s{i}")
    h.clock.now += 10_000
    sizes = []
    while True:
        ended, more = h.tree.expire(10)
        sizes.append(len(ended))
        if not more:
            break
    assert sizes == [10, 10, 5]
    assert h.tree.live_sessions == 0


def test_a_parent_placed_below_its_root_before_a_first_request_joins_that_tree_and_leaves_nothing_behind():
    h = Harness()
    h.tree.place_parent("c", "p", "r", "dep")  # p had no request yet; its root r is known elsewhere
    turn = h.begin("c", "p")
    assert turn.ctx.root == "r" and turn.ctx.parent == "p"
    assert h.tree.named_only("p") and h.tree.named_only("r") and not h.tree.named_only("c")
    assert (h.tree.live_sessions, h.tree.live_trees) == (3, 1)
    h.end(turn)
    # no-ops: the session is held, its parent is, or the parent is the root
    h.tree.place_parent("c", "q", "s", "dep")
    h.tree.place_parent("d", "p", "x", "dep")
    h.tree.place_parent("e", "t", "t", "dep")
    assert (h.tree.live_sessions, h.tree.live_trees) == (3, 1)
    assert h.tree.root_of("q") is None and h.tree.root_of("x") is None and h.tree.root_of("t") is None
    h.end(h.begin("c", final=True))  # its tree ends with it: its placeholders go too
    assert (h.tree.live_sessions, h.tree.live_trees) == (0, 0)
