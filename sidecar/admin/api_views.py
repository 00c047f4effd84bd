"""API sessions in the memory store's lineage views (``/v1/trees/{root}``, ``/ui/data.json``) and
the root of an API session.

With the memory store the lineage tree (:mod:`sidecar.lineage`) holds a session once a request
named it, and the API sessions table (:mod:`sidecar.sessions`) holds what the sessions API
created. The views show both, one node per session with the same fields:

- an API session the tree holds as a session is the tree's node;
- one the tree holds only as a placeholder (a child's request named it as its parent) is drawn
  as the API session it is (not a placeholder; closed and ended once closed or expired);
- one the tree does not hold (no request of it or below it yet) is added to the tree of its
  root, below its parent: the active ones, and the ancestors they hang from.

(With the shared store, API sessions are records like any other: :mod:`sidecar.state.views`.)

:func:`overlay_steps` reads the API table once per view (bounded: ``sessions.api.max_sessions``
active sessions and the tombstones); :func:`view_steps` builds one tree with what it found,
within the view's bounds (``max_nodes``, ``max_depth``: an added session beyond them is counted in
``omitted``). Both are view builders as :mod:`sidecar.lineage` defines them: generators that
pause every ``VIEW_STEP`` steps, run in slices by :func:`sidecar.admin.views.run_sliced`.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from sidecar.admin.views import MAX_DEPTH
from sidecar.context import EndReason
from sidecar.lineage import VIEW_STEP, SessionTree, TreeView, prompt_cache, unknown_node
from sidecar.sessions import ApiSession, SessionStatus, SessionStore

__all__ = ["API_END_REASONS", "Overlay", "api_node", "api_root", "overlay_steps", "view_steps"]

# Why an API session ended, when no request of it made the lineage tree record a reason.
API_END_REASONS = {
    SessionStatus.CLOSED: EndReason.API_CLOSED.value,
    SessionStatus.EXPIRED: EndReason.IDLE_EXPIRED.value,
}


def api_root(tree: SessionTree, store: SessionStore, rec: ApiSession) -> str:
    """The root of an API session's tree: the lineage tree's once it holds the session or an
    ancestor (a request placed it there), else the one it was created with (its parent's).
    Follows at most ``MAX_DEPTH`` API parents (then the root it was created with)."""
    cur = rec
    for _ in range(MAX_DEPTH):
        root = tree.root_of(cur.id)
        if root is not None:
            return root
        if cur.parent is None:
            return cur.id
        above = store.get(cur.parent)
        if above is None:  # forgotten, or not an API session: the tree's, or as created
            return tree.root_of(cur.parent) or cur.root or cur.id
        cur = above
    return rec.root or rec.id


def api_node(rec: ApiSession, root: str, offset: float) -> dict[str, Any]:
    """An API session the lineage tree does not hold as a session, as a view's node dict: the
    fields of :meth:`SessionTree.get`'s, times on the tree's clock (``offset``: wall-clock
    seconds minus the tree's clock)."""
    ended = rec.status is not SessionStatus.ACTIVE
    created = rec.created_at - offset
    return {
        "session": rec.id,
        "parent": rec.parent,
        "root": root,
        "deployment": rec.deployment,
        "created_at": created,
        "last_active_at": created if rec.last_active_at is None else rec.last_active_at - offset,
        "turns": 0,
        "in_flight": rec.in_flight,
        "final_turn_seen": False,
        "ended": ended,
        "end_reason": API_END_REASONS.get(rec.status),
        "closed": ended,
        "placeholder": False,
        "workers": [],
        "affinity": {"first": 0, "same_worker": 0, "moved": 0},
        "prompt_cache": prompt_cache(0, 0, 0, 0),
    }


@dataclass(slots=True)
class Overlay:
    """The API sessions of one view, read by :func:`overlay_steps`."""

    offset: float  # wall-clock seconds minus the tree's clock
    named: dict[str, ApiSession] = field(default_factory=dict)  # held by the tree as placeholders only
    added: dict[str, list[ApiSession]] = field(default_factory=dict)  # root -> not held, parents first
    roots: dict[str, str] = field(default_factory=dict)  # id -> root, of the added sessions
    newest: dict[str, float] = field(default_factory=dict)  # root -> its added sessions' newest activity
    live: int = 0  # active sessions among the added

    def root_of(self, tree: SessionTree, session: str) -> str | None:
        """The root of the tree ``session`` is shown in; None when no view shows it."""
        return tree.root_of(session) or self.roots.get(session)


def overlay_steps(tree: SessionTree, store: SessionStore, *, step: int = VIEW_STEP) -> Generator[None, None, Overlay]:
    """What the views add to ``tree`` of the API sessions in ``store``; touches each record once
    (and each added session's parent once more)."""
    overlay = Overlay(time.time() - tree.now())
    records = list(store.records.values())  # one C-level copy: the table may change during a pause
    alone: list[ApiSession] = []  # active, not held by the tree
    countdown = step
    for rec in records:
        countdown -= 1
        if not countdown:
            countdown = step
            yield
        if tree.root_of(rec.id) is not None:
            if tree.named_only(rec.id):
                overlay.named[rec.id] = rec
        elif rec.status is SessionStatus.ACTIVE:
            alone.append(rec)
    roots = overlay.roots
    for rec in alone:
        # the chain of API sessions the tree does not hold up from it, to one already added
        chain: list[ApiSession] = []
        seen: set[str] = set()
        cur: ApiSession | None = rec
        while cur is not None and cur.id not in roots and cur.id not in seen:
            chain.append(cur)
            seen.add(cur.id)
            parent = cur.parent
            if parent is None or tree.root_of(parent) is not None:
                break
            cur = store.get(parent)  # None: forgotten (or, through a reused id, not an API session)
            countdown -= 1
            if not countdown:
                countdown = step
                yield
        for above in reversed(chain):  # parents first: a child finds its parent's root
            parent = above.parent
            if parent is None:
                root = above.id
            else:
                root = roots.get(parent) or tree.root_of(parent) or above.root or above.id
                root = tree.root_of(root) or root  # (a root as created may have joined a tree since)
            roots[above.id] = root
            overlay.added.setdefault(root, []).append(above)
            at = (above.last_active_at or above.created_at) - overlay.offset
            overlay.newest[root] = max(overlay.newest.get(root, at), at)
            if above.status is SessionStatus.ACTIVE:
                overlay.live += 1
    return overlay


def view_steps(
    tree: SessionTree,
    overlay: Overlay,
    root: str,
    *,
    max_depth: int,
    max_nodes: int,
    step: int = VIEW_STEP,
) -> Generator[None, None, TreeView | None]:
    """The view of the tree of ``root`` (:meth:`SessionTree.view`'s, or a tree of API sessions
    alone) with ``overlay``'s API sessions in it; None when no view shows such a tree. Added
    sessions hang below their parents, oldest first among siblings, after the tree's own
    sessions took their share of ``max_nodes``; those cut are counted in ``omitted`` of the
    shown node they hang below (or of the root, when their parent was cut by the tree's view)."""
    added = overlay.added.get(root, [])
    view = None
    if tree.root_of(root) is not None:
        view = yield from tree.view(root, max_depth=max_depth, max_nodes=max_nodes, step=step)
    if view is None:
        if not added:
            return None
        top_rec = next((rec for rec in added if rec.id == root), None)  # None: forgotten
        top = unknown_node(root, root) if top_rec is None else api_node(top_rec, root, overlay.offset)
        top["children"] = []
        top["subtree_prompt_cache"] = top["prompt_cache"]  # (API sessions have no usage before a request)
        view = TreeView(top, 0, 0, True, 0, top["last_active_at"] or 0.0, 1, 0)
    top = view.tree
    live = view.live
    final = view.final
    # the shown nodes by id, with their depth
    shown: dict[str, tuple[dict[str, Any], int]] = {}
    stack = [(top, 0)]
    countdown = step
    while stack:
        d, depth = stack.pop()
        shown[d["session"]] = (d, depth)
        stack.extend((c, depth + 1) for c in d["children"])
        countdown -= 1
        if not countdown:
            countdown = step
            yield
        rec = overlay.named.get(d["session"]) if d["placeholder"] else None
        if rec is not None:
            d.update(api_node(rec, d["root"], overlay.offset))
            if rec.status is SessionStatus.ACTIVE:
                live += 1
                final = False
    sessions, in_flight, newest = view.sessions, view.in_flight, view.last_active_at
    count, omitted = view.shown, view.omitted
    cut: dict[str, dict[str, Any]] = {}  # id of an added session cut -> the node it is counted in
    grown: dict[str, dict[str, Any]] = {}  # nodes given children here
    for rec in added:
        countdown -= 1
        if not countdown:
            countdown = step
            yield
        sessions += 1
        in_flight += rec.in_flight
        if rec.status is SessionStatus.ACTIVE:
            live += 1
            final = False
        newest = max(newest, (rec.last_active_at or rec.created_at) - overlay.offset)
        if rec.id in shown:  # the top of a tree of API sessions alone
            continue
        parent = rec.parent
        above = shown.get(parent) if parent is not None else None
        if above is None:
            anchor = cut.get(parent) if parent is not None else None
            if anchor is None and (parent is None or tree.root_of(parent) is None):
                above = (top, 0)  # its parent is forgotten: it hangs below the root
            elif anchor is None:
                anchor = top  # below a session the tree's view cut
        else:
            anchor = None
        if above is not None and above[1] < max_depth and count < max_nodes:
            d = api_node(rec, root, overlay.offset)
            d["children"] = []
            d["subtree_prompt_cache"] = d["prompt_cache"]
            above[0]["children"].append(d)
            grown[above[0]["session"]] = above[0]
            shown[rec.id] = (d, above[1] + 1)
            count += 1
            continue
        if anchor is None:
            assert above is not None
            anchor = above[0]
        anchor["omitted"] = anchor.get("omitted", 0) + 1
        cut[rec.id] = anchor
        omitted += 1
    for d in grown.values():  # siblings oldest first, as the tree's views order them
        d["children"].sort(key=lambda c: (c["created_at"], c["session"]))
    return TreeView(top, sessions, live, final, in_flight, newest, count, omitted)
