"""The session tree frees what leaves it by reference counting alone.

Compiled, its nodes are not tracked by the cyclic garbage collector (a full collection would walk
every held session), so a node still in a reference cycle when it leaves the tree would never be
freed. These tests run every lifecycle path with the collector disabled and count the interpreter's
allocated blocks: in both builds, nothing that left the tree may stay allocated.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sidecar import lineage
from sidecar.compiled import is_compiled
from sidecar.context import TurnOutcome
from sidecar.lineage import SessionTree

COMPLETED = TurnOutcome.COMPLETED


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def churn(tree: SessionTree, clock: Clock, rounds: int, tag: str) -> None:
    """Every way a session comes and goes: roots, children, grandchildren, root hints, unknown
    parents (placeholders), final turns, API closes while in flight and the id reused while the
    closed session drains (take-over), an ended parent's id reused while its child lives (revival),
    eviction and idle expiry."""
    for i in range(rounds):
        r, c, g, h, p, orphan = (f"{tag}{i}-{k}" for k in ("r", "c", "g", "h", "p", "o"))
        tr, _ = tree.begin(r, None, None, False, "d")
        tc, _ = tree.begin(c, r, None, False, "d")
        tg, _ = tree.begin(g, c, None, True, "d")
        th, _ = tree.begin(h, None, r, True, "d")
        to, _ = tree.begin(orphan, p, None, False, "d")  # p: a placeholder parent
        tree.finish(tg, COMPLETED)
        tree.finish(th, COMPLETED)
        tree.set_mode_state(tc, "state")
        tree.record_worker(tc, "w1")
        tree.record_worker(tc, "w2")
        tree.finish(tc, COMPLETED)
        # closed while in flight, its id taken over by a new session while it drains
        tree.close(r)
        again, _ = tree.begin(r, None, None, False, "d")
        tree.finish(tr, COMPLETED)
        tree.finish(again, COMPLETED)
        # an ended parent held for its live child, its id revived
        tree.close(c)
        revived, _ = tree.begin(c, None, None, True, "d")
        tree.finish(revived, COMPLETED)
        tree.finish(to, COMPLETED)
        if i % 3 == 0:
            tree.close(orphan)
        clock.now += 1.0
        if i % 50 == 49:
            tree.expire()


def seed(tree: SessionTree, session: str, above: str | None, now: float, **facts: Any) -> None:
    """What a shared store knows of ``session`` (below ``above``, its tree's root), into ``tree``."""
    tree.seed(
        session,
        above,
        above or session,
        hinted=False,
        deployment="d",
        turns=1,
        final_seen=False,
        created=now,
        last_active=now,
        mode_state=None,
        **facts,
    )


def left_after_shutdown(fill: Callable[[SessionTree], None], **options: Any) -> int:
    """Blocks still allocated after a tree filled by ``fill`` was shut down and dropped (collector
    off: reference counting only), against before it was made."""
    with collector_off():
        baseline = sys.getallocatedblocks()
        tree = SessionTree(**options)
        fill(tree)
        assert tree.shutdown()
        assert tree.live_sessions == 0
        del tree
        return sys.getallocatedblocks() - baseline


def test_nodes_that_leave_the_tree_are_freed_without_the_collector() -> None:
    clock = Clock()
    tree = SessionTree(clock=clock, max_live=50, tombstone_max=300, idle_ttl=30.0, tombstone_ttl=60.0)
    with collector_off():
        # Warm up: the tree's dict, the tombstones and the interpreter's caches reach their size.
        churn(tree, clock, 600, "warm")
        before = sys.getallocatedblocks()
        churn(tree, clock, 3000, "run")  # about 25,000 sessions and placeholders come and go
        after = sys.getallocatedblocks()
    assert tree.evictions > 0 and tree.tombstone_reuses > 0  # the paths ran
    # A leak keeps at least one block per node (tens of thousands); what may differ is the
    # set of live sessions at the two points (bounded by max_live) and allocator noise.
    assert after - before < 2_000, (before, after)


def test_a_tree_frees_everything_after_shutdown() -> None:
    clock = Clock()

    def fill(tree: SessionTree) -> None:
        churn(tree, clock, 2000, "x")
        assert tree.live_sessions > 1000  # in flight and idle sessions, held parents, placeholders

    left = left_after_shutdown(fill, clock=clock, max_live=100_000)
    assert left < 1_000, left


def test_shared_tree_frees_seeded_placeholders_after_shutdown() -> None:
    clock = Clock()

    def fill(tree: SessionTree) -> None:
        for i in range(5000):
            # a placeholder the store knows, with no child here; and a session under another
            seed(tree, f"p{i}", None, clock.now, placeholder=True)
            seed(tree, f"s{i}", f"q{i}", clock.now, workers=["w", 2])

    left = left_after_shutdown(fill, clock=clock, max_live=100_000, shared=True)
    assert left < 1_000, left


def test_compiled_nodes_are_not_tracked_by_the_collector() -> None:
    tree = SessionTree()
    turn, _ = tree.begin("a", None, None, False, "d")
    node = turn.node
    # Compiled: out of the collector's reach (full collections do not walk the tree); from source,
    # tracked like any object.
    assert gc.is_tracked(node) is not is_compiled(lineage)


def test_compiled_session_index_is_not_tracked_by_the_collector() -> None:
    # The index of a million sessions would otherwise be walked by every full collection: each
    # way a node enters it (a new session, a placeholder parent, a take-over) leaves it untracked.
    clock = Clock()
    tree = SessionTree(clock=clock)
    expected = not is_compiled(lineage)
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("new session", lambda: tree.begin("root", None, None, False, "d")),
        ("placeholder parent", lambda: tree.begin("child", "unknown-parent", None, False, "d")),
        ("in flight, closed", lambda: tree.close("root")),
        ("take-over of the draining id", lambda: tree.begin("root", None, None, False, "d")),
    ]
    for step, run in steps:
        run()
        assert gc.is_tracked(tree._nodes) is expected, step
    assert len(tree._detached["root"]) == 1  # the take-over ran: the closed node drains detached


def test_a_chain_of_parents_longer_than_the_cap_stays_within_it() -> None:
    # Each link names the previous one as its parent. Evicting a link with a child frees nothing
    # (it stays as the child's ancestor): before, the chain kept every link past the cap (5000
    # nodes here), and each new link evicted every other idle session trying to make room.
    cap = 100
    tree = SessionTree(max_live=cap, clock=lambda: 0.0)
    for i in range(1, 5000):
        turn, _ = tree.begin(f"link-{i}", f"link-{i - 1}" if i > 1 else None, None, False, "d")
        if i == 2:
            assert turn.ctx.parent == "link-1"  # below the cap, lineage as declared
        # over the cap by at most the session in flight (never evicted)
        assert tree.live_sessions + tree.held_ancestors <= cap + 1 and len(tree._nodes) <= cap + 1
        tree.finish(turn, TurnOutcome.COMPLETED)
    assert tree.lineage_dropped > 0
