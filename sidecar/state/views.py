"""The lineage views (``/v1/trees/{root}``, ``/ui/data.json``) read from the shared store, so any
replica shows the whole fleet's trees, turns counted across replicas: the same node dicts as
:meth:`sidecar.lineage.SessionTree.view` builds from a local tree, with RFC 3339 times.

A tree is read level by level from the root (two pipelined round trips per level: children ids,
then their records), cut at ``max_depth`` levels and ``max_nodes`` nodes. A cut node carries
``omitted``: here the number of its children not shown (their own descendants are not counted:
the store is not walked past the cut). Of a node's children at most ``MAX_CHILDREN_READ`` ids are
read (a children set can grow to millions): a node with more carries ``truncated`` (true), its
shown children are chosen among those read. Each replica's last writes are included (the store
is flushed first); other replicas' last ``flush_interval_ms`` of writes may be missing.

A store failure or timeout raises StoreUnavailable and leaves the request path's breaker alone.
"""

from __future__ import annotations

from typing import Any

from sidecar.sessions import rfc3339
from sidecar.state.records import Record
from sidecar.state.redis import MAX_CHILDREN_READ, RedisState


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
    }


def _runs(flat: list[Any] | None) -> list[dict[str, Any]]:
    return [] if not flat else [{"worker": flat[i], "turns": flat[i + 1]} for i in range(0, len(flat), 2)]


def _placeholder(session: str, root: str) -> dict[str, Any]:
    """A node the store no longer holds a record of (its key expired): shown as a placeholder."""
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
    }


async def tree_view(
    state: RedisState, session: str, *, max_depth: int, max_nodes: int
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The tree ``session`` belongs to, from its root, and its counts (sessions, live,
    in_flight, final, last_active_at, omitted); None when the store has no such session."""
    found = (await state.fetch([session]))[session]
    if found is None:
        return None
    root = found.root
    top_rec = found if root == session else (await state.fetch([root]))[root]
    top = node_dict(top_rec, root) if top_rec is not None else _placeholder(root, root)
    top["children"] = []
    counts = {"sessions": 0, "live": 0, "in_flight": 0, "final": True, "last_active_at": 0.0, "omitted": 0}
    _count(counts, top_rec)
    level = [(root, top)]
    budget = max_nodes - 1
    depth = 0
    while level:
        showing = depth < max_depth and budget > 0
        kids = await state.children([sid for sid, _ in level], budget if showing else 0)
        ids = [kid for sid, _ in level for kid in kids[sid][0]]
        records = await state.fetch(ids[:budget], skip_unreadable=True) if showing else {}
        next_level = []
        for sid, d in level:
            listed, total = kids[sid]
            if showing and total > MAX_CHILDREN_READ:
                d["truncated"] = True
            shown = [r for k in listed if (r := records.get(k)) is not None]
            shown.sort(key=lambda r: (r.created, r.id))
            for rec in shown:
                if budget <= 0 or depth >= max_depth:
                    break
                child = node_dict(rec, root)
                child["children"] = []
                d["children"].append(child)
                _count(counts, rec)
                next_level.append((rec.id, child))
                budget -= 1
            gone = sum(1 for k in listed if k in records and records[k] is None)  # records expired
            cut = total - gone - len(d["children"])
            if cut > 0:
                d["omitted"] = cut
                counts["omitted"] += cut
        level = next_level
        depth += 1
    return top, counts


def _count(counts: dict[str, Any], rec: Record | None) -> None:
    if rec is None:
        return
    counts["sessions"] += 1
    counts["in_flight"] += rec.in_flight
    counts["last_active_at"] = max(counts["last_active_at"], rec.last_active)
    if not rec.placeholder and not rec.ended:
        counts["live"] += 1
        if not rec.final_seen:
            counts["final"] = False


async def ui_snapshot(state: RedisState, *, limit: int, max_nodes: int, max_depth: int) -> dict[str, Any]:
    """``/ui/data.json`` from the store: the most recently active trees of the whole fleet (the
    shape of sidecar.admin.ui's local snapshot; times are unix seconds, ``now`` included)."""
    roots: list[str] = []
    recent = await state.recent(limit * 4)
    records = await state.fetch(recent, skip_unreadable=True)
    for sid in recent:
        rec = records.get(sid)
        if rec is not None and rec.root not in roots:
            roots.append(rec.root)
        if len(roots) >= limit:
            break
    trees = []
    budget = max_nodes
    for root in roots:
        if budget <= 0:
            break
        built = await tree_view(state, root, max_depth=max_depth, max_nodes=budget)
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
    live = await state.live_count()
    now = state.wall()  # (the sessions' times are the store's clock)
    return {
        "now": now,
        "generated_at": now,
        "live_sessions": live,
        "live_trees": None,
        "limit": limit,
        "shown_trees": len(trees),
        "truncated": len(roots) < live or any(t["omitted"] for t in trees),
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
