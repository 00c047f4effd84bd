"""The lineage views (``/v1/trees/{root}``, ``/ui/data.json``) read from the shared store, so any
replica shows the whole fleet's trees, turns counted across replicas: the same node dicts as
:meth:`sidecar.lineage.SessionTree.view` builds from a local tree, with RFC 3339 times.

A tree is read level by level from the root, cut at ``max_depth`` levels and ``max_nodes`` nodes.
A cut node carries ``omitted``: here the number of its children not shown (their own descendants
are not counted: the store is not walked past the cut). Of a node's children at most
``MAX_CHILDREN_READ`` ids are read (a children set can grow to millions): a node with more
carries ``truncated`` (true), its shown children are chosen among those read. Each replica's last
writes are included (the store is flushed first); other replicas' last ``flush_interval_ms`` of
writes may be missing.

The views share the event loop with the proxy, so they read in steps: each round trip reads the
children counts of at most ``VIEW_STEP`` sessions, about ``IDS_PER_TRIP`` child ids, or the
records of at most ``VIEW_STEP`` sessions, and the node dicts of those records are built before
the next await. No step holds the loop for more than a few milliseconds, whatever the tree's
size; the caller builds one view at a time (:func:`sidecar.admin.views.views_lock`). Like the
local views, a view is then a slightly inconsistent snapshot: other replicas write meanwhile.

A store failure or timeout raises StoreUnavailable and leaves the request path's breaker alone.
"""

from __future__ import annotations

from typing import Any

from sidecar.lineage import VIEW_STEP, exhaust, prompt_cache, subtree_totals, unknown_node
from sidecar.sessions import rfc3339
from sidecar.state.records import Record
from sidecar.state.redis import MAX_CHILDREN_READ, RedisState

IDS_PER_TRIP = 1024  # child ids one scan round trip of a view lists, about (a node with more: one trip)
LIVE_READ = 10_000  # live sessions the live view reads the roots of (it counts their trees)
ROOTS_STEP = VIEW_STEP  # of them per round trip


def node_dict(rec: Record, root: str) -> dict[str, Any]:
    """One session as a tree view shows it (the fields of SessionTree.get's node dicts)."""
    ended = rec.ended
    return {
        "session": rec.id,
        "parent": rec.parent,
        "root": root,
        "deployment": rec.deployment,
        "created_at": rfc3339(rec.created),
        "last_active_at": rfc3339(rec.last_active),
        "turns": rec.turns,
        "in_flight": rec.in_flight,
        "final_turn_seen": rec.final_seen,
        "ended": ended,
        "end_reason": rec.end_reason if ended else None,
        "closed": rec.closing or ended,
        "placeholder": rec.placeholder,
        "workers": _runs(rec.workers),
        "affinity": {
            "first": 1 if rec.worker_turns else 0,
            "same_worker": max(rec.worker_turns - 1 - rec.moves, 0),
            "moved": rec.moves,
        },
        "prompt_cache": prompt_cache(*rec.usage),
    }


def _runs(flat: list[Any] | None) -> list[dict[str, Any]]:
    return [] if not flat else [{"worker": flat[i], "turns": flat[i + 1]} for i in range(0, len(flat), 2)]


async def tree_view(
    state: RedisState, session: str, *, max_depth: int, max_nodes: int, fresh: bool = True
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The tree ``session`` belongs to, from its root, and its counts (sessions, live,
    in_flight, final, last_active_at, omitted); None when the store has no such session. Each
    node's ``subtree_prompt_cache`` sums the sessions read at and below it.
    ``fresh``: write this replica's pending changes first (see RedisState.fetch)."""
    found = (await state.fetch([session], fresh=fresh))[session]
    if found is None:
        return None
    root = found.root
    top_rec = found if root == session else (await state.fetch([root], fresh=False))[root]
    top = node_dict(top_rec, root) if top_rec is not None else unknown_node(root, root)
    top["children"] = []
    walk = _Walk(state, root, max_nodes=max_nodes - 1)  # (the root is always shown)
    walk.count(top_rec)
    level = [(root, top)]
    depth = 0
    while level:
        showing = depth < max_depth and walk.budget > 0
        below: list[tuple[str, dict[str, Any]]] = []
        for start in range(0, len(level), VIEW_STEP):
            below += await walk.expand(level[start : start + VIEW_STEP], showing=showing)
        level = below
        depth += 1
    exhaust(subtree_totals(top))  # (over the dicts built: at most max_nodes)
    return top, walk.counts


class _Walk:
    """One tree view being read: its node budget and counts, the ids shown."""

    def __init__(self, state: RedisState, root: str, *, max_nodes: int) -> None:
        self.state = state
        self.root = root
        self.budget = max_nodes
        self.counts: dict[str, Any] = {
            "sessions": 0,
            "live": 0,
            "in_flight": 0,
            "final": True,
            "last_active_at": 0.0,
            "omitted": 0,
        }
        self.shown: set[str] = set()

    def count(self, rec: Record | None) -> None:
        if rec is None:
            return
        counts = self.counts
        counts["sessions"] += 1
        counts["in_flight"] += rec.in_flight
        counts["last_active_at"] = max(counts["last_active_at"], rec.last_active)
        if not rec.placeholder and not rec.ended:
            counts["live"] += 1
            if not rec.final_seen:
                counts["final"] = False

    async def expand(
        self, batch: list[tuple[str, dict[str, Any]]], *, showing: bool
    ) -> list[tuple[str, dict[str, Any]]]:
        """Hang the children of these nodes (at most VIEW_STEP of one level, in order: earlier
        nodes' children win the budget) under their dicts; the children shown, to expand next."""
        state = self.state
        totals = await state.child_counts([sid for sid, _ in batch])
        listed = await self._list(batch, totals) if showing else [[] for _ in batch]
        built: dict[str, tuple[Record, dict[str, Any]]] = {}
        gone: set[str] = set()
        wanted = [kid for kids in listed for kid in kids]
        for start in range(0, len(wanted), VIEW_STEP):
            step = wanted[start : start + VIEW_STEP]
            records = await state.fetch(step, skip_unreadable=True, fresh=False)
            for kid in step:
                if kid not in records:
                    continue  # unreadable: left out (counted as cut)
                rec = records[kid]
                if rec is None:
                    gone.add(kid)  # its record expired
                else:
                    built[kid] = (rec, node_dict(rec, self.root))
        below = []
        for (_, d), total, kids in zip(batch, totals, listed, strict=True):
            if showing and total > MAX_CHILDREN_READ:
                d["truncated"] = True
            found = sorted((built[k] for k in kids if k in built), key=lambda rc: (rc[0].created, rc[0].id))
            children = d["children"]
            for rec, child in found:
                if self.budget <= 0:
                    break
                if rec.id in self.shown:
                    continue  # listed under two parents (an id reused): shown once
                self.shown.add(rec.id)
                child["children"] = []
                children.append(child)
                self.count(rec)
                below.append((rec.id, child))
                self.budget -= 1
            cut = total - sum(1 for k in kids if k in gone) - len(children)
            if cut > 0:
                d["omitted"] = cut
                self.counts["omitted"] += cut
        return below

    async def _list(self, batch: list[tuple[str, dict[str, Any]]], totals: list[int]) -> list[list[str]]:
        """The child ids to read of each node, at most the budget in all (earlier nodes first):
        scan steps only for nodes that have children, about IDS_PER_TRIP ids per round trip."""
        listed: list[list[str]] = [[] for _ in batch]
        room = self.budget
        limit = min(room, MAX_CHILDREN_READ)
        group: list[int] = []
        size = 0
        for i, total in enumerate(totals):
            if total <= 0 or room <= 0:
                continue
            n = min(total, limit)
            room -= n  # (what the scan will list about; the exact cut is made below)
            if group and size + n > IDS_PER_TRIP:
                await self._scan(batch, group, limit, listed)
                group, size = [], 0
            group.append(i)
            size += n
        if group:
            await self._scan(batch, group, limit, listed)
        room = self.budget
        for i, kids in enumerate(listed):
            listed[i] = kids[: max(room, 0)]
            room -= len(listed[i])
        return listed

    async def _scan(
        self, batch: list[tuple[str, dict[str, Any]]], group: list[int], limit: int, listed: list[list[str]]
    ) -> None:
        rows = await self.state.child_ids([(batch[i][0], limit) for i in group])
        for i, row in zip(group, rows, strict=True):
            listed[i] = row


async def live_trees(state: RedisState) -> tuple[list[str], int, bool]:
    """The roots of the live sessions, the most recently active tree first, read from at most
    ``LIVE_READ`` live sessions (``ROOTS_STEP`` per round trip); how many live sessions the
    store holds; whether every one was read (then the roots are all the live trees; else a
    part of them)."""
    live = await state.live_count()
    roots: dict[str, None] = {}
    read = 0
    every = False
    while read < LIVE_READ:
        asked = min(ROOTS_STEP, LIVE_READ - read)
        ids = await state.recent(read, asked)
        for root in await state.roots(ids):
            if root is not None:
                roots[root] = None
        read += len(ids)
        if len(ids) < asked:
            every = True  # the end of the live set (it may change meanwhile: a snapshot)
            break
    return list(roots), live, every or read >= live


async def ui_snapshot(state: RedisState, *, limit: int, max_nodes: int, max_depth: int) -> dict[str, Any]:
    """``/ui/data.json`` from the store: the most recently active trees of the whole fleet (the
    shape of sidecar.admin.ui's local snapshot; times are unix seconds, ``now`` included).
    ``live_trees`` counts the trees of the live sessions read (:func:`live_trees`), exact when
    ``live_trees_exact``, else a lower bound."""
    await state.flush_pending()
    roots, live, exact = await live_trees(state)
    trees = []
    budget = max_nodes
    for root in roots[:limit]:
        if budget <= 0:
            break
        built = await tree_view(state, root, max_depth=max_depth, max_nodes=budget, fresh=False)
        if built is None:
            continue
        tree, counts = built
        _unix_times(tree)
        budget -= counts["sessions"]  # (the sessions shown: a tree's cut ones are not counted)
        trees.append(
            {
                "root": root,
                "last_active_at": counts["last_active_at"],
                "sessions": counts["sessions"],
                "live": counts["live"],
                "in_flight": counts["in_flight"],
                "final": counts["final"],
                "omitted": counts["omitted"],
                "tree": tree,
            }
        )
    now = state.wall()  # (the sessions' times are the store's clock)
    return {
        "now": now,
        "generated_at": now,
        "live_sessions": live,
        "live_trees": len(roots),
        "live_trees_exact": exact,
        "limit": limit,
        "shown_trees": len(trees),
        "truncated": not exact or len(trees) < len(roots) or any(t["omitted"] for t in trees),
        "trees": trees,
    }


def _unix_times(tree: dict[str, Any]) -> None:
    """The live page computes idle times from unix seconds: convert a tree's RFC 3339 times."""
    from datetime import datetime

    stack = [tree]
    while stack:
        node = stack.pop()
        for key in ("created_at", "last_active_at"):
            value = node.get(key)
            if isinstance(value, str):
                node[key] = datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        stack.extend(node["children"])
