"""Live session view on the admin listener: ``GET /ui`` and ``GET /ui/data.json``.

``/ui`` is an HTML page with its stylesheet and script (``sidecar/admin/static``, read from the
installed package when the app is built, served from this listener as ``/ui/static/ui.css`` and
``/ui/static/ui.js``: nothing is fetched from elsewhere, and the Content-Security-Policy allows no
inline script or style). It polls ``ui/data.json`` every 2.5 seconds and draws every live
session tree: each session's state, turns, finality and, when the node dicts carry them, its
worker history (``workers``) and affinity outcome counts (``affinity``). The trees hold the
sessions learned from traffic and those created through the sessions API, with or without a
request of their own (:mod:`sidecar.admin.api_views`), one node dict shape for both. Session
ids are client-supplied: the page only ever puts them in the DOM through ``textContent`` and
attributes, never as markup.

``/ui/data.json`` is bounded whatever the number of sessions held:

- at most ``limit`` trees (query parameter, default 200, at most 1000), most recently active
  tree first (a tree's activity is the newest ``last_active_at`` of its sessions);
- at most ``MAX_NODES`` sessions in all, each tree's root always included; when a tree is
  cut, the node whose children were dropped carries ``omitted`` (how many sessions below it
  are not shown) and the tree entry carries the total in its own ``omitted``;
- nesting at most ``MAX_DEPTH`` levels, cut the same way (keeps deep chains JSON- and
  browser-safe). ``GET /v1/trees/{root}`` cuts trees with the same bounds and markers.

Shape::

    {"now": <tree clock, seconds>, "generated_at": <unix time>,
     "live_sessions": int, "live_trees": int, "live_trees_exact": bool, "limit": int,
     "shown_trees": int, "truncated": bool,
     "trees": [{"root": id, "last_active_at": float, "sessions": int, "live": int,
                "in_flight": int, "final": bool, "omitted": int,
                "tree": {<node dict as SessionTree.get() returns it>, "subtree_prompt_cache": {...},
                         "children": [...]}}],
     "prompt_cache": {"window_seconds": 900, "slot_seconds": 30, "turn_buckets": [...],
                      "by_turn": [{"turn", "prompt_tokens", "cached_tokens", "cached_ratio",
                                   "reported_responses"}, ...],
                      "unknown_responses": int,
                      "series": [{"at": <unix time>, "prompt_tokens": [per bucket],
                                  "cached_tokens": [...], "reported_responses": [...],
                                  "unknown_responses": int}, ...]}}

``prompt_cache`` (present when the sidecar accounts usage) is this replica's own responses of
the last 15 minutes, in 30-second slots, oldest first (slots without responses left out): a
fixed ring (:mod:`sidecar.accounting`), whatever the traffic. Each node's
``subtree_prompt_cache`` sums its own ``prompt_cache`` and its descendants'; the root's is the
tree's.

``live_trees`` counts the trees with a live session, exactly here; with a shared store
(:func:`sidecar.state.views.ui_snapshot`) it is exact when ``live_trees_exact``, else a lower
bound (the store's snapshot reads the roots of at most 10,000 live sessions). ``truncated`` is
true when trees or sessions are not shown: fewer trees than ``live_trees`` (or than there may be),
or a tree cut.

``sessions`` counts every node of the tree (placeholders and held ended sessions included),
``live`` the ones neither ended nor placeholders, ``final`` is True when every such session
has seen its final turn or ended. Timestamps here are seconds on the tree's clock, and ``now``
is on it too, so ``now - last_active_at`` is a session's idle time.

A snapshot touches every held node once to order the trees and once more per shown tree to
count what it cuts, every API session once (the table is bounded), and builds only the node
dicts it shows. It is built in slices of about 2 ms with the event loop serving requests in
between (:mod:`sidecar.admin.views`), so it is a
slightly inconsistent snapshot when requests change the tree meanwhile: a tree, or a session,
may appear as it was a few milliseconds apart from another, and counts are what the walk saw.
One view is built at a time (a snapshot or a ``/v1/trees`` view), and each snapshot is reused
for ``CACHE_SECONDS`` or ten times what it cost the loop (at most ``CACHE_MAX_SECONDS``), so the
view takes at most about a tenth of the event loop it shares with the proxy, however many
pages poll it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Generator
from importlib import resources
from typing import Any

import orjson
from aiohttp import web

from sidecar.admin.api_views import overlay_steps, view_steps
from sidecar.admin.views import MAX_DEPTH, MAX_NODES, run_sliced, views_lock
from sidecar.lineage import SessionTree
from sidecar.sessions import SessionStore

__all__ = [
    "DEFAULT_LIMIT",
    "MAX_DEPTH",
    "MAX_LIMIT",
    "MAX_NODES",
    "STATIC",
    "add_ui_routes",
    "snapshot",
    "snapshot_steps",
    "static_files",
]

DEFAULT_LIMIT = 200
MAX_LIMIT = 1000
CACHE_SECONDS = 1.0
CACHE_COST_FACTOR = 10.0  # a snapshot that cost the loop t seconds is reused for 10 t: at most ~10% of it
CACHE_MAX_SECONDS = 30.0

# The page's files in sidecar/admin/static: the path each is served at, and its content type.
STATIC = {
    "ui.html": ("/ui", "text/html"),
    "ui.css": ("/ui/static/ui.css", "text/css"),
    "ui.js": ("/ui/static/ui.js", "text/javascript"),
}

_SECURITY_HEADERS = {
    # The page loads its own script and stylesheet and fetches its own data.json, nothing else;
    # no inline script or style runs (client-supplied session ids are drawn on it).
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def add_ui_routes(
    app: web.Application,
    tree_getter: Callable[[], SessionTree],
    authorize: Callable[[web.Request], None] | None = None,
    store_snapshot: Callable[[int], Awaitable[dict[str, Any]]] | None = None,
    api_getter: Callable[[], SessionStore] | None = None,
    prompt_cache: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """Add ``GET /ui`` (the page) and ``GET /ui/data.json`` (its snapshot) to ``app``.

    ``authorize`` guards the snapshot (it exposes session ids): it raises to refuse a request.
    The page itself holds no data; it sends the token given as ``/ui#token=<token>``.
    ``store_snapshot(limit)``: the snapshot of a shared session store (the whole fleet's trees,
    sidecar.state.views), used instead of the local tree's. ``api_getter``: the API sessions the
    local snapshot shows with the tree's (:mod:`sidecar.admin.api_views`). ``prompt_cache``: the
    prompt-cache aggregates of this replica's last 15 minutes
    (:meth:`sidecar.accounting.Accounting.snapshot`), served as the snapshot's ``prompt_cache``.
    """
    cache: dict[int, tuple[float, bytes]] = {}  # limit -> (valid until, body)
    # one view at a time (this snapshot or a tree view); pollers arriving meanwhile reuse it
    building = views_lock(app)

    async def page_slash(request: web.Request) -> web.Response:
        raise web.HTTPFound("../ui")

    def cached(limit: int) -> bytes | None:
        hit = cache.get(limit)
        return hit[1] if hit is not None and time.monotonic() < hit[0] else None

    async def data(request: web.Request) -> web.Response:
        if authorize is not None:
            authorize(request)
        try:
            limit = int(request.query.get("limit", DEFAULT_LIMIT))
        except ValueError:
            limit = DEFAULT_LIMIT
        limit = max(1, min(limit, MAX_LIMIT))
        body = cached(limit)
        if body is None:
            async with building:
                body = cached(limit)
                if body is None:
                    if store_snapshot is not None:
                        began = time.monotonic()
                        snap = await store_snapshot(limit)
                        cost = time.monotonic() - began
                    else:
                        api = None if api_getter is None else api_getter()
                        snap, cost = await run_sliced(snapshot_steps(tree_getter(), limit=limit, api=api))
                    if prompt_cache is not None:
                        snap["prompt_cache"] = prompt_cache()
                    started = time.monotonic()
                    body = orjson.dumps(snap)
                    now = time.monotonic()
                    cost += now - started
                    cache.clear()
                    cache[limit] = (now + min(max(CACHE_SECONDS, cost * CACHE_COST_FACTOR), CACHE_MAX_SECONDS), body)
        return web.Response(body=body, content_type="application/json", headers=_SECURITY_HEADERS)

    for name, body in static_files().items():
        path, content_type = STATIC[name]
        app.router.add_get(path, _serve(body, content_type))
    app.router.add_get("/ui/", page_slash)
    app.router.add_get("/ui/data.json", data)


def static_files() -> dict[str, bytes]:
    """The page's files (the keys of :data:`STATIC`), read from the installed package (a wheel
    or a source tree alike)."""
    folder = resources.files("sidecar.admin").joinpath("static")
    return {name: folder.joinpath(name).read_bytes() for name in STATIC}


def _serve(body: bytes, content_type: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type, charset="utf-8", headers=_SECURITY_HEADERS)

    return handler


async def snapshot(
    tree: SessionTree,
    *,
    limit: int = DEFAULT_LIMIT,
    max_nodes: int = MAX_NODES,
    max_depth: int = MAX_DEPTH,
    api: SessionStore | None = None,
) -> dict[str, Any]:
    """The bounded view of ``tree`` (and of the API sessions of ``api``) that ``/ui/data.json``
    serves (shape in the module doc), built in slices that let the event loop run in between."""
    snap, _ = await run_sliced(snapshot_steps(tree, limit=limit, max_nodes=max_nodes, max_depth=max_depth, api=api))
    return snap


def snapshot_steps(
    tree: SessionTree,
    *,
    limit: int = DEFAULT_LIMIT,
    max_nodes: int = MAX_NODES,
    max_depth: int = MAX_DEPTH,
    api: SessionStore | None = None,
) -> Generator[None, None, dict[str, Any]]:
    """:func:`snapshot` as a view builder (see :mod:`sidecar.lineage`): pauses every few
    hundred nodes, returns the snapshot."""
    budget = max(max_nodes, 1)
    trees: list[dict[str, Any]] = []
    overlay = None if api is None else (yield from overlay_steps(tree, api))
    recent = yield from tree.recent_trees(limit)
    live_sessions, live_trees = tree.live_sessions, tree.live_trees
    if overlay is not None:
        # trees of API sessions alone (no request in them yet), ordered with the tree's by activity
        alone = [(root, at) for root, at in overlay.newest.items() if tree.root_of(root) is None]
        recent = sorted(recent + alone, key=lambda tree_at: tree_at[1], reverse=True)[:limit]
        live_sessions += overlay.live
        live_trees += len(alone)
    for root, _ in recent:
        yield  # a pause between trees too: hundreds of small trees make no pause of their own
        if overlay is None:
            view = yield from tree.view(root, max_depth=max_depth, max_nodes=max(budget, 1))
        else:
            view = yield from view_steps(tree, overlay, root, max_depth=max_depth, max_nodes=max(budget, 1))
        if view is None:  # gone while the snapshot was being built
            continue
        budget -= view.shown
        trees.append(
            {
                "root": view.tree["session"],
                "last_active_at": view.last_active_at,
                "sessions": view.sessions,
                "live": view.live,
                "in_flight": view.in_flight,
                "final": view.final,
                "omitted": view.omitted,
                "tree": view.tree,
            }
        )
    return {
        "now": tree.now(),
        "generated_at": time.time(),
        "live_sessions": live_sessions,
        "live_trees": live_trees,
        "live_trees_exact": True,
        "limit": limit,
        "shown_trees": len(trees),
        "truncated": len(trees) < live_trees or any(t["omitted"] for t in trees),
        "trees": trees,
    }
