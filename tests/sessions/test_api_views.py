"""API sessions in the memory store's views, on hand-built trees and tables: where each one hangs,
what the views' bounds cut, and inputs no API call makes (a parent cycle through reused ids, a
forgotten root) still end."""

from __future__ import annotations

from typing import Any

from sidecar.admin.api_views import api_root, overlay_steps, view_steps
from sidecar.config import ApiSessionsConfig
from sidecar.context import TurnOutcome
from sidecar.lineage import SessionTree, TreeView, exhaust
from sidecar.sessions import SessionStore
from tests.sessions.support import walk


def _setup(*chain: tuple[str, str | None, str | None]) -> tuple[SessionTree, SessionStore]:
    """A tree and an API table holding (id, parent, root as created) of each session."""
    tree = SessionTree()
    store = SessionStore(ApiSessionsConfig(tombstone_max=2))
    for sid, parent, root in chain:
        store.create(deployment="d", workspace=None, session_id=sid, parent=parent, root=root)
    return tree, store


def _view(tree: SessionTree, store: SessionStore, root: str, **bounds: int) -> TreeView | None:
    overlay = exhaust(overlay_steps(tree, store, step=2))
    bounds = {"max_depth": 48, "max_nodes": 2000, **bounds}
    return exhaust(view_steps(tree, overlay, root, step=2, **bounds))


def _shape(node: dict[str, Any]) -> Any:
    return (node["session"], [_shape(c) for c in node["children"]])


def _request(tree: SessionTree, session: str, parent: str | None = None) -> None:
    turn, _ = tree.begin(session, parent=parent, root_hint=None, final=False, deployment="d")
    tree.finish(turn, TurnOutcome.COMPLETED)


def test_a_chain_without_requests_is_one_tree_and_its_bounds_cut_it():
    tree, store = _setup(*[(f"c{i}", None if i == 0 else f"c{i - 1}", None if i == 0 else "c0") for i in range(60)])
    view = _view(tree, store, "c0")
    assert view is not None and len(walk(view.tree)) == 49 and view.omitted == 11
    nodes = walk(view.tree)
    assert nodes[-1]["session"] == "c48" and nodes[-1]["omitted"] == 11  # all below it
    assert sum("omitted" in n for n in nodes) == 1 and all(n["root"] == "c0" for n in nodes)
    assert (view.sessions, view.live, view.final, view.shown) == (60, 60, False, 49)
    small = _view(tree, store, "c0", max_nodes=5)
    assert small is not None and small.shown == 5 and small.omitted == 55
    assert [api_root(tree, store, rec) for rec in store.records.values()] == ["c0"] * 60


def test_a_session_named_by_a_childs_request_is_drawn_as_the_api_session_it_is():
    tree, store = _setup(("p", None, None), ("c", "p", "p"), ("c2", "p", "p"))
    _request(tree, "c", "p")  # p: a placeholder in the lineage tree
    view = _view(tree, store, "p")
    # (siblings oldest first: c2 was created before c's first request made c's node)
    assert view is not None and _shape(view.tree) == ("p", [("c2", []), ("c", [])])
    assert {n["session"]: (n["placeholder"], n["turns"]) for n in walk(view.tree)} == {
        "p": (False, 0),
        "c2": (False, 0),
        "c": (False, 1),
    }
    assert (view.sessions, view.live) == (3, 3)


def test_a_forgotten_root_is_shown_as_a_placeholder_and_a_cycle_of_reused_ids_ends():
    tree, store = _setup(("r", None, None), ("k", "r", "r"))
    store.close("r")
    for sid in ("x", "y", "z"):  # r's tombstone is dropped (tombstone_max 2)
        store.create(deployment="d", workspace=None, session_id=sid)
        store.close(sid)
    assert store.get("r") is None
    view = _view(tree, store, "r")
    assert view is not None and _shape(view.tree) == ("r", [("k", [])])
    assert view.tree["placeholder"] is True and view.tree["deployment"] is None and view.tree["created_at"] is None
    # a and b each name the other as parent (ids reused after their tombstones went): no loop
    store.create(deployment="d", workspace=None, session_id="a", parent="b", root="b")
    store.create(deployment="d", workspace=None, session_id="b", parent="a", root="a")
    overlay = exhaust(overlay_steps(tree, store))
    assert {overlay.roots["a"], overlay.roots["b"]} <= {"a", "b"}
    for root in {overlay.roots["a"], overlay.roots["b"]}:
        assert exhaust(view_steps(tree, overlay, root, max_depth=48, max_nodes=2000)) is not None
    assert api_root(tree, store, store.records["a"]) in {"a", "b"}
