"""Live session view on the admin listener: ``GET /ui`` and ``GET /ui/data.json``.

``/ui`` is one self-contained HTML page (inline CSS and JS, nothing fetched from elsewhere)
that polls ``ui/data.json`` every 2.5 seconds and draws every live session tree: each session's
state, turns, finality and, when the node dicts carry them, its worker history (``workers``)
and affinity outcome counts (``affinity``). Session ids are client-supplied: the page only
ever puts them in the DOM through ``textContent`` and attributes, never as markup.

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
     "live_sessions": int, "live_trees": int, "limit": int, "shown_trees": int,
     "truncated": bool,
     "trees": [{"root": id, "last_active_at": float, "sessions": int, "live": int,
                "in_flight": int, "final": bool, "omitted": int,
                "tree": {<node dict as SessionTree.get() returns it>, "children": [...]}}]}

``sessions`` counts every node of the tree (placeholders and held ended sessions included),
``live`` the ones neither ended nor placeholders, ``final`` is True when every such session
has seen its final turn or ended. Timestamps here are seconds on the tree's clock, and ``now``
is on it too, so ``now - last_active_at`` is a session's idle time.

A snapshot touches every held node once to order the trees and once more per shown tree to
count what it cuts, and builds only the node dicts it shows. It is built in slices of about
2 ms with the event loop serving requests in between (:mod:`sidecar.admin.views`), so it is a
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
from typing import Any

import orjson
from aiohttp import web

from sidecar.admin.views import MAX_DEPTH, MAX_NODES, run_sliced, views_lock
from sidecar.lineage import SessionTree

__all__ = ["DEFAULT_LIMIT", "MAX_DEPTH", "MAX_LIMIT", "MAX_NODES", "add_ui_routes", "snapshot", "snapshot_steps"]

DEFAULT_LIMIT = 200
MAX_LIMIT = 1000
CACHE_SECONDS = 1.0
CACHE_COST_FACTOR = 10.0  # a snapshot that cost the loop t seconds is reused for 10 t: at most ~10% of it
CACHE_MAX_SECONDS = 30.0

_SECURITY_HEADERS = {
    # The page loads nothing from elsewhere; only its own data.json is fetched.
    "Content-Security-Policy": ("default-src 'none'; script-src 'unsafe-inline'; "
                                "style-src 'unsafe-inline'; connect-src 'self'; img-src data:; "
                                "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def add_ui_routes(app: web.Application, tree_getter: Callable[[], SessionTree],
                  authorize: Callable[[web.Request], None] | None = None,
                  store_snapshot: Callable[[int], Awaitable[dict[str, Any]]] | None = None) -> None:
    """Add ``GET /ui`` (the page) and ``GET /ui/data.json`` (its snapshot) to ``app``.

    ``authorize`` guards the snapshot (it exposes session ids): it raises to refuse a request.
    The page itself holds no data; it sends the token given as ``/ui#token=<token>``.
    ``store_snapshot(limit)``: the snapshot of a shared session store (the whole fleet's trees,
    sidecar.state.views), used instead of the local tree's.
    """
    cache: dict[int, tuple[float, bytes]] = {}  # limit -> (valid until, body)
    # one view at a time (this snapshot or a tree view); pollers arriving meanwhile reuse it
    building = views_lock(app)

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html", charset="utf-8",
                            headers=_SECURITY_HEADERS)

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
                        snap, cost = await run_sliced(snapshot_steps(tree_getter(), limit=limit))
                    started = time.monotonic()
                    body = orjson.dumps(snap)
                    now = time.monotonic()
                    cost += now - started
                    cache.clear()
                    cache[limit] = (now + min(max(CACHE_SECONDS, cost * CACHE_COST_FACTOR), CACHE_MAX_SECONDS),
                                    body)
        return web.Response(body=body, content_type="application/json", headers=_SECURITY_HEADERS)

    app.router.add_get("/ui", page)
    app.router.add_get("/ui/", page_slash)
    app.router.add_get("/ui/data.json", data)


async def snapshot(tree: SessionTree, *, limit: int = DEFAULT_LIMIT, max_nodes: int = MAX_NODES,
                   max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """The bounded view of ``tree`` that ``/ui/data.json`` serves (shape in the module doc),
    built in slices that let the event loop run in between."""
    snap, _ = await run_sliced(snapshot_steps(tree, limit=limit, max_nodes=max_nodes, max_depth=max_depth))
    return snap


def snapshot_steps(tree: SessionTree, *, limit: int = DEFAULT_LIMIT, max_nodes: int = MAX_NODES,
                   max_depth: int = MAX_DEPTH) -> Generator[None, None, dict[str, Any]]:
    """:func:`snapshot` as a view builder (see :mod:`sidecar.lineage`): pauses every few
    hundred nodes, returns the snapshot."""
    budget = max(max_nodes, 1)
    trees: list[dict[str, Any]] = []
    for root in (yield from tree.recent_roots(limit)):
        yield  # a pause between trees too: hundreds of small trees make no pause of their own
        view = yield from tree.view(root, max_depth=max_depth, max_nodes=max(budget, 1))
        if view is None:  # gone while the snapshot was being built
            continue
        budget -= view.shown
        trees.append({"root": view.tree["session"], "last_active_at": view.last_active_at,
                      "sessions": view.sessions, "live": view.live, "in_flight": view.in_flight,
                      "final": view.final, "omitted": view.omitted, "tree": view.tree})
    return {
        "now": tree.now(),
        "generated_at": time.time(),
        "live_sessions": tree.live_sessions,
        "live_trees": tree.live_trees,
        "limit": limit,
        "shown_trees": len(trees),
        "truncated": len(trees) < tree.live_trees or any(t["omitted"] for t in trees),
        "trees": trees,
    }


PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Sessions</title>
<style>
:root {
  --bg: #f6f6f3; --card: #ffffff; --ink: #1f2328; --muted: #6a717b; --faint: #9aa1aa;
  --line: #c5c9ce; --border: #e3e5e8; --hover: #f1f4f8;
  --green: #1a7f37; --green-bg: #dcf3e2; --blue: #0a5fc7; --blue-bg: #dbe9fb;
  --amber: #8a5300; --amber-bg: #fbecc8; --grey: #57606a; --grey-bg: #eaecef;
  --red: #b42318; --red-bg: #fde4e1;
  --mono: ui-monospace, "SFMono-Regular", "DejaVu Sans Mono", "Liberation Mono", Menlo, Consolas, monospace;
  --sans: system-ui, -apple-system, "Segoe UI", "DejaVu Sans", "Liberation Sans", Arial, sans-serif;
}
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--ink); font: 13px/1.4 var(--sans); }
header { position: sticky; top: 0; z-index: 2; background: var(--bg); border-bottom: 1px solid var(--border);
  padding: 10px 18px 8px; display: flex; flex-wrap: wrap; align-items: center; gap: 8px 18px; }
h1 { font-size: 15px; margin: 0; font-weight: 650; letter-spacing: .01em; }
h1 small { font-weight: 400; color: var(--muted); margin-left: 6px; }
.stats { display: flex; gap: 14px; color: var(--muted); }
.stats b { color: var(--ink); font: 600 14px var(--mono); margin-right: 3px; }
.tools { margin-left: auto; display: flex; align-items: center; gap: 8px; }
.tools input { font: 12px var(--mono); padding: 4px 8px; width: 220px; border: 1px solid var(--line);
  border-radius: 5px; background: #fff; color: var(--ink); }
.tools button { font: 12px var(--sans); padding: 4px 10px; border: 1px solid var(--line); border-radius: 5px;
  background: #fff; color: var(--ink); cursor: pointer; }
.tools button:hover { background: var(--hover); }
#status { font-size: 12px; color: var(--muted); min-width: 150px; text-align: right; }
#status::before { content: ""; display: inline-block; width: 7px; height: 7px; border-radius: 50%;
  margin-right: 6px; background: var(--green); vertical-align: 1px; }
#status.stale::before { background: var(--faint); }
#status.error { color: var(--red); }
#status.error::before { background: var(--red); }
.legend { display: flex; flex-wrap: wrap; align-items: center; gap: 6px 8px; padding: 8px 18px 0; color: var(--muted); font-size: 12px; }
.legend .pill { cursor: help; }
.legend .hint { color: var(--faint); }
main { padding: 10px 18px 24px; display: flex; flex-direction: column; gap: 10px; }
.note { color: var(--muted); padding: 2px 2px; }
.empty { color: var(--muted); padding: 40px 0; text-align: center; font-size: 14px; }
section.tree { background: var(--card); border: 1px solid var(--border); border-radius: 8px;
  box-shadow: 0 1px 2px rgba(31,35,40,.04); }
section.tree > .head { display: flex; align-items: center; gap: 10px; padding: 6px 10px;
  border-bottom: 1px solid var(--border); color: var(--muted); font-size: 12px; cursor: pointer; user-select: none; }
section.tree.collapsed > .head { border-bottom: 0; }
section.tree.collapsed > .body { display: none; }
.head .caret { width: 10px; color: var(--faint); font-size: 10px; }
.head .rootid { color: var(--ink); font: 600 12.5px var(--mono); }
.head .sum { display: flex; gap: 10px; }
.head .age { margin-left: auto; }
.treefinal { color: var(--green); font-weight: 600; }
.body { padding: 6px 10px 8px; overflow-x: auto; }
ul.lineage, ul.lineage ul { list-style: none; margin: 0; padding: 0; }
ul.lineage ul { margin-left: 9px; }
ul.lineage ul > li { position: relative; padding-left: 18px; }
ul.lineage ul > li::before { content: ""; position: absolute; left: 0; top: 0; bottom: 0;
  border-left: 1px solid var(--line); }
ul.lineage ul > li:last-child::before { bottom: auto; height: 13px; }
ul.lineage ul > li::after { content: ""; position: absolute; left: 0; top: 13px; width: 13px;
  border-top: 1px solid var(--line); }
.row { display: flex; align-items: center; gap: 8px; min-height: 26px; padding: 1px 6px; border-radius: 4px;
  white-space: nowrap; }
.row:hover { background: var(--hover); }
.row.match { background: #fff6d6; }
.id { font: 12.5px var(--mono); color: var(--ink); min-width: 0; }
.node.ended > .row .id, .node.placeholder > .row .id { color: var(--muted); }
.node.placeholder > .row .id { font-style: italic; }
.pill { display: inline-block; font-size: 11px; font-weight: 600; padding: 1px 7px; border-radius: 10px;
  min-width: 62px; text-align: center; }
.s-active { color: var(--green); background: var(--green-bg); }
.s-inflight { color: var(--blue); background: var(--blue-bg); }
.s-final { color: var(--amber); background: var(--amber-bg); }
.s-closing { color: var(--red); background: var(--red-bg); }
.s-ended { color: var(--grey); background: var(--grey-bg); }
.s-placeholder { color: var(--grey); background: transparent; border: 1px dashed var(--faint); padding: 0 6px; }
.meta { color: var(--muted); font-size: 12px; }
.meta b { color: var(--ink); font-weight: 600; }
.tag { font-size: 11px; padding: 0 6px; border-radius: 3px; border: 1px solid var(--border); color: var(--muted); }
.tag.final { color: var(--amber); border-color: #ecd49a; background: #fff8e6; }
.tag.flight { color: var(--blue); border-color: #b9d3f5; background: #f1f7ff; }
.tag.reason { color: var(--grey); }
.tag.hint { color: var(--muted); border-style: dashed; }
.workers { display: inline-flex; align-items: center; gap: 3px; font: 11.5px var(--mono); color: var(--muted); }
.workers .w { padding: 0 5px; border-radius: 3px; background: #eef1f4; color: var(--ink); }
.workers .w.moved { background: var(--amber-bg); color: var(--amber); }
.workers .x { color: var(--faint); }
.aff { font-size: 11.5px; color: var(--muted); }
.aff b { font-weight: 600; color: var(--ink); }
.dep { font: 11px var(--mono); color: var(--faint); }
.more { color: var(--muted); font-style: italic; padding: 2px 6px; min-height: 22px; }
</style>
</head>
<body>
<header>
  <h1>Sessions<small>live lineage</small></h1>
  <div class="stats">
    <span><b id="n-sessions">–</b>live sessions</span>
    <span><b id="n-trees">–</b>live trees</span>
    <span><b id="n-flight">–</b>in flight</span>
  </div>
  <div class="tools">
    <input id="filter" type="search" placeholder="filter by session id" autocomplete="off" spellcheck="false">
    <button id="pause" type="button">Pause</button>
    <span id="status" class="stale">connecting…</span>
  </div>
</header>
<div class="legend" id="legend"></div>
<main id="trees"><div class="empty">Loading…</div></main>
<script>
"use strict";
(function () {
  var REFRESH_MS = 2500, ID_MAX = 28;
  var treesEl = document.getElementById("trees");
  var statusEl = document.getElementById("status");
  var filterEl = document.getElementById("filter");
  var pauseEl = document.getElementById("pause");
  var collapsed = new Set();
  var paused = false, last = null, timer = null;

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function shortId(id) {
    id = String(id);
    return id.length > ID_MAX ? id.slice(0, ID_MAX - 11) + "\u2026" + id.slice(-10) : id;
  }
  function idEl(id, cls) {
    var e = el("span", cls || "id", shortId(id));
    e.title = String(id);
    return e;
  }
  function ago(seconds) {
    if (!(seconds >= 0)) return "";
    if (seconds < 1) return "now";
    if (seconds < 60) return Math.floor(seconds) + "s";
    if (seconds < 3600) return Math.floor(seconds / 60) + "m" + (seconds < 600 ? " " + Math.floor(seconds % 60) + "s" : "");
    if (seconds < 86400) return Math.floor(seconds / 3600) + "h " + Math.floor(seconds % 3600 / 60) + "m";
    return Math.floor(seconds / 86400) + "d";
  }
  function state(n) {
    if (n.placeholder) return ["placeholder", "s-placeholder", "named by a child or a root hint; no request of its own yet"];
    if (n.ended) return ["ended", "s-ended", "ended" + (n.end_reason ? " (" + String(n.end_reason).replace(/_/g, " ") + ")" : "") +
      "; kept while sessions below it are live"];
    if (n.closed) return ["closing", "s-closing", "closed through the API; draining in-flight requests"];
    if (n.in_flight > 0) return ["in flight", "s-inflight", n.in_flight + " request(s) in flight"];
    if (n.final_turn_seen) return ["final", "s-final", "final turn seen"];
    return ["active", "s-active", "live, idle between turns"];
  }

  function legend() {
    var box = document.getElementById("legend");
    box.appendChild(el("span", null, "states"));
    [{}, {in_flight: 1}, {final_turn_seen: true}, {closed: true}, {ended: true}, {placeholder: true}].forEach(function (n) {
      var s = state(n), p = el("span", "pill " + s[1], s[0]);
      p.title = s[2];
      box.appendChild(p);
    });
    box.appendChild(el("span", "hint", "\u00b7 hover an id for the full id, a state for its meaning"));
  }

  // workers: runs of turns on one worker, oldest first: [{worker, turns}, ...]
  function workersEl(workers) {
    var box = el("span", "workers");
    var runs = workers.map(function (r) {
      return [r && r.worker !== undefined && r.worker !== null ? String(r.worker) : "?", Number(r && r.turns) || 1];
    });
    box.title = "worker per run of turns: " + runs.map(function (r) { return r[0] + " \u00d7" + r[1]; }).join(" \u2192 ");
    var shown = runs.length > 6 ? runs.slice(runs.length - 6) : runs;
    if (shown !== runs) box.appendChild(el("span", "x", "\u2026"));
    shown.forEach(function (r, i) {
      if (i > 0 || shown !== runs) box.appendChild(el("span", "x", "\u2192"));
      var chip = el("span", "w" + ((i > 0 || shown !== runs) ? " moved" : ""), shortWorker(r[0]));
      chip.title = r[0];
      box.appendChild(chip);
      if (r[1] > 1) box.appendChild(el("span", "x", "\u00d7" + r[1]));
    });
    return box;
  }
  function shortWorker(w) { return w.length > 18 ? w.slice(0, 8) + "\u2026" + w.slice(-8) : w; }
  function affinityEl(aff) {
    var box = el("span", "aff");
    if (aff && typeof aff === "object" && !Array.isArray(aff)) {
      box.appendChild(document.createTextNode("affinity "));
      Object.keys(aff).forEach(function (k, i) {
        if (i) box.appendChild(document.createTextNode(" \u00b7 "));
        box.appendChild(document.createTextNode(k + " "));
        box.appendChild(el("b", null, aff[k]));
      });
    } else {
      box.textContent = "affinity " + String(aff);
    }
    return box;
  }

  function nodeEl(n, depth, now, needle, deployments) {
    var s = state(n);
    var li = el("li", "node " + s[1].slice(2));
    if (n.placeholder) li.classList.add("placeholder");
    if (n.ended) li.classList.add("ended");
    li.dataset.session = String(n.session);
    var row = el("div", "row");
    if (needle && String(n.session).toLowerCase().indexOf(needle) >= 0) row.classList.add("match");
    var pill = el("span", "pill " + s[1], s[0]);
    pill.title = s[2];
    row.appendChild(pill);
    row.appendChild(idEl(n.session));
    if (!n.placeholder) {
      var t = el("span", "meta");
      t.appendChild(el("b", null, n.turns));
      t.appendChild(document.createTextNode(n.turns === 1 ? " turn" : " turns"));
      row.appendChild(t);
    }
    if (n.in_flight > 1 || (n.in_flight > 0 && s[0] !== "in flight")) row.appendChild(el("span", "tag flight", n.in_flight + " in flight"));
    if (n.final_turn_seen && !n.ended && s[0] !== "final") row.appendChild(el("span", "tag final", "final turn seen"));
    if (n.ended && n.end_reason) row.appendChild(el("span", "tag reason", String(n.end_reason).replace(/_/g, " ")));
    if (depth > 0 && n.parent === null && !n.placeholder) {
      var h = el("span", "tag hint", "via root hint");
      h.title = "joined this tree through a root hint; no declared parent";
      row.appendChild(h);
    }
    if (Array.isArray(n.workers) && n.workers.length) row.appendChild(workersEl(n.workers));
    if (n.affinity !== undefined && n.affinity !== null) row.appendChild(affinityEl(n.affinity));
    if (deployments > 1 || (n.deployment && n.deployment !== "default")) row.appendChild(el("span", "dep", n.deployment));
    if (!n.placeholder && typeof n.last_active_at === "number") {
      var idle = ago(now - n.last_active_at);
      var a = el("span", "meta", n.in_flight > 0 ? "" : n.ended ? "ended " + idle + (idle === "now" ? "" : " ago") : "idle " + idle);
      a.title = "created " + ago(now - n.created_at) + " ago";
      row.appendChild(a);
    }
    li.appendChild(row);
    var kids = n.children || [];
    if (kids.length || n.omitted) {
      var ul = el("ul");
      kids.forEach(function (c) { ul.appendChild(nodeEl(c, depth + 1, now, needle, deployments)); });
      if (n.omitted) ul.appendChild(el("li", "more", "\u2026 " + n.omitted + " more session" + (n.omitted === 1 ? "" : "s") + " not shown"));
      li.appendChild(ul);
    }
    return li;
  }

  function matches(n, needle) {
    var stack = [n];
    while (stack.length) {
      var x = stack.pop();
      if (String(x.session).toLowerCase().indexOf(needle) >= 0) return true;
      (x.children || []).forEach(function (c) { stack.push(c); });
    }
    return false;
  }
  function deploymentCount(t) {
    var seen = new Set(), stack = [t];
    while (stack.length) { var x = stack.pop(); seen.add(x.deployment); (x.children || []).forEach(function (c) { stack.push(c); }); }
    return seen.size;
  }

  function treeEl(t, now, needle) {
    var sec = el("section", "tree");
    var root = String(t.root);
    sec.dataset.root = root;
    if (collapsed.has(root)) sec.classList.add("collapsed");
    var head = el("div", "head");
    head.appendChild(el("span", "caret", collapsed.has(root) ? "\u25b6" : "\u25bc"));
    head.appendChild(idEl(root, "rootid"));
    var sum = el("span", "sum");
    sum.appendChild(el("span", null, t.sessions + (t.sessions === 1 ? " session" : " sessions")));
    if (t.live !== t.sessions) sum.appendChild(el("span", null, t.live + " live"));
    if (t.in_flight) sum.appendChild(el("span", null, t.in_flight + " in flight"));
    var fin = el("span", t.final ? "treefinal" : null, t.final ? "tree final \u2713" : "tree open");
    fin.title = t.final ? "every live session of this tree has seen its final turn" : "some session still expects more turns";
    sum.appendChild(fin);
    if (t.omitted) sum.appendChild(el("span", null, t.omitted + " not shown"));
    head.appendChild(sum);
    head.appendChild(el("span", "age", "active " + ago(now - t.last_active_at) + (now - t.last_active_at < 1 ? "" : " ago")));
    head.addEventListener("click", function () {
      if (collapsed.has(root)) collapsed.delete(root); else collapsed.add(root);
      if (last) render(last);
    });
    sec.appendChild(head);
    var body = el("div", "body");
    var ul = el("ul", "lineage");
    ul.appendChild(nodeEl(t.tree, 0, now, needle, deploymentCount(t.tree)));
    body.appendChild(ul);
    sec.appendChild(body);
    return sec;
  }

  function render(d) {
    var needle = filterEl.value.trim().toLowerCase();
    var frag = document.createDocumentFragment();
    var inFlight = 0;
    (d.trees || []).forEach(function (t) { inFlight += t.in_flight || 0; });
    document.getElementById("n-sessions").textContent = d.live_sessions;
    document.getElementById("n-trees").textContent = d.live_trees;
    document.getElementById("n-flight").textContent = inFlight;
    document.title = "Sessions (" + d.live_sessions + " live)";
    var shown = (d.trees || []).filter(function (t) { return !needle || matches(t.tree, needle); });
    if (d.truncated) {
      frag.appendChild(el("div", "note", "Showing the " + d.shown_trees + " most recently active of " + d.live_trees +
        " trees" + (d.trees.some(function (t) { return t.omitted; }) ? "; large trees are cut" : "") + "."));
    }
    if (!shown.length) {
      frag.appendChild(el("div", "empty", needle ? "No session matches the filter." : "No live sessions."));
    }
    shown.forEach(function (t) { frag.appendChild(treeEl(t, d.now, needle)); });
    treesEl.replaceChildren(frag);
  }

  // A bearer token for sidecars whose admin API needs one: /ui#token=<token> (the fragment never
  // leaves the browser); kept for this tab only.
  var token = null;
  var m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  if (m) {
    token = decodeURIComponent(m[1]);
    try { sessionStorage.setItem("sidecar-token", token); } catch (e) {}
    history.replaceState(null, "", location.pathname + location.search);
  } else {
    try { token = sessionStorage.getItem("sidecar-token"); } catch (e) {}
  }

  function setStatus(text, cls) { statusEl.textContent = text; statusEl.className = cls || ""; }

  function tick() {
    timer = null;
    if (paused) return;
    var ctrl = new AbortController();
    var abort = setTimeout(function () { ctrl.abort(); }, 5000);
    var headers = token ? {"Authorization": "Bearer " + token} : {};
    fetch("ui/data.json", {cache: "no-store", signal: ctrl.signal, headers: headers})
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(function (d) {
        last = d;
        render(d);
        setStatus("updated " + new Date().toLocaleTimeString(), "");
      })
      .catch(function (e) { setStatus("cannot reach the sidecar (" + (e && e.message || e) + ")", "error"); })
      .finally(function () { clearTimeout(abort); if (!paused) timer = setTimeout(tick, REFRESH_MS); });
  }

  filterEl.addEventListener("input", function () { if (last) render(last); });
  pauseEl.addEventListener("click", function () {
    paused = !paused;
    pauseEl.textContent = paused ? "Resume" : "Pause";
    if (paused) { if (timer) clearTimeout(timer); timer = null; setStatus("paused", "stale"); }
    else tick();
  });
  legend();
  tick();
})();
</script>
</body>
</html>
"""
