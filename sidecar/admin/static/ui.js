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
  // SVG drawn with DOM calls (the page's policy allows no inline markup or style), in the
  // namespace the page's own <svg> elements were parsed into
  var SVG_NS = document.getElementById("chart-turns").namespaceURI;
  function svg(tag, attrs, cls) {
    var e = document.createElementNS(SVG_NS, tag);
    Object.keys(attrs || {}).forEach(function (k) { e.setAttribute(k, String(attrs[k])); });
    if (cls) e.setAttribute("class", cls);
    return e;
  }
  function titled(e, text) { var t = svg("title"); t.textContent = text; e.appendChild(t); return e; }
  function pct(ratio) { return typeof ratio === "number" ? Math.round(ratio * 100) + "%" : "\u2013"; }
  function tokens(n) {
    n = Number(n) || 0;
    if (n >= 1e9) return (n / 1e9).toFixed(1) + "G";
    if (n >= 1e6) return (n / 1e6).toFixed(1) + "M";
    if (n >= 1e4) return (n / 1e3).toFixed(0) + "k";
    if (n >= 1e3) return (n / 1e3).toFixed(1) + "k";
    return String(n);
  }
  // a prompt_cache object: {prompt_tokens, cached_tokens, cached_ratio, reported_turns, unknown_turns}
  function cacheTitle(pc) {
    var out = pc.prompt_tokens > 0 ? "cached " + Number(pc.cached_tokens).toLocaleString() + " of " +
      Number(pc.prompt_tokens).toLocaleString() + " prompt tokens over " + pc.reported_turns +
      (pc.reported_turns === 1 ? " turn" : " turns") : "no response reported its prompt-cache usage";
    if (pc.unknown_turns) out += "; " + pc.unknown_turns + (pc.unknown_turns === 1 ? " turn" : " turns") + " without usage";
    return out;
  }
  // a session's (tag) or a tree's (bar) cached ratio; nothing until a response reported usage
  function cacheEl(pc, withBar) {
    if (!pc || typeof pc !== "object" || !(pc.prompt_tokens > 0)) return null;
    var box = el("span", withBar ? "cacheratio" : "tag cache");
    box.title = cacheTitle(pc);
    box.dataset.cachedRatio = String(pc.cached_ratio);
    if (withBar) {
      var bar = svg("svg", {viewBox: "0 0 44 8", "aria-hidden": "true"});
      bar.appendChild(svg("rect", {x: 0, y: 0, width: 44, height: 8, rx: 2}, "track"));
      var w = Math.max(0, Math.min(1, pc.cached_ratio)) * 44;
      bar.appendChild(svg("rect", {x: 0, y: 0, width: w.toFixed(1), height: 8, rx: 2}, "fill"));
      box.appendChild(bar);
      box.appendChild(document.createTextNode(pct(pc.cached_ratio) + " cached of " + tokens(pc.prompt_tokens)));
    } else {
      box.appendChild(document.createTextNode("cache " + pct(pc.cached_ratio)));
    }
    return box;
  }

  // -- prompt-cache charts (data.json's prompt_cache: this sidecar's last 15 minutes) ---------------
  var CH = {w: 360, h: 150, left: 34, right: 8, top: 14, bottom: 22};
  function gridY(chart, w, h) {
    var plot = h - CH.top - CH.bottom;
    [0, 0.5, 1].forEach(function (r) {
      var y = CH.top + plot * (1 - r);
      chart.appendChild(svg("line", {x1: CH.left, x2: w - CH.right, y1: y, y2: y}, r === 0 ? "axis" : "grid"));
      var label = svg("text", {x: CH.left - 5, y: y + 3.5, "text-anchor": "end"});
      label.textContent = Math.round(r * 100) + "%";
      chart.appendChild(label);
    });
    return plot;
  }
  function drawTurns(chart, pc) {
    var w = CH.w, h = CH.h, buckets = pc.by_turn || [];
    chart.setAttribute("viewBox", "0 0 " + w + " " + h);
    chart.replaceChildren();
    var plot = gridY(chart, w, h);
    var slot = (w - CH.left - CH.right) / Math.max(buckets.length, 1);
    buckets.forEach(function (b, i) {
      var x = CH.left + slot * i + slot * 0.18, bw = slot * 0.64;
      var has = b.prompt_tokens > 0, ratio = has ? Math.max(0, Math.min(1, b.cached_ratio)) : 0;
      var bh = plot * ratio, y = CH.top + plot - bh;
      var bar = svg("rect", {x: x.toFixed(1), y: y.toFixed(1), width: bw.toFixed(1), height: bh.toFixed(1),
        "data-turn": b.turn, "data-ratio": has ? b.cached_ratio : ""}, "bar" + (i === 0 ? " first" : ""));
      titled(bar, "turn " + b.turn + ": " + (has ? pct(b.cached_ratio) + " cached (" + Number(b.cached_tokens).toLocaleString() +
        " of " + Number(b.prompt_tokens).toLocaleString() + " prompt tokens, " + b.reported_responses + " responses)" : "no responses"));
      chart.appendChild(bar);
      var value = svg("text", {x: (x + bw / 2).toFixed(1), y: (y - 3).toFixed(1), "text-anchor": "middle"}, "value");
      value.textContent = has ? pct(b.cached_ratio) : "";
      chart.appendChild(value);
      var label = svg("text", {x: (x + bw / 2).toFixed(1), y: h - 7, "text-anchor": "middle"});
      label.textContent = (i === 0 ? "turn " : "") + b.turn;
      chart.appendChild(label);
    });
  }
  // the series drawn over time: every turn, turn 1, turn 2 on (the buckets summed)
  var SERIES = [["all turns", "s-all", 0], ["turn 1", "s-first", 0, 1], ["turn 2 on", "s-later", 1]];
  function seriesRatio(slot, s) {
    var p = 0, c = 0, n = slot.prompt_tokens.length, hi = s.length > 3 ? s[3] : n;
    for (var i = s[2]; i < hi; i++) { p += slot.prompt_tokens[i] || 0; c += slot.cached_tokens[i] || 0; }
    return p > 0 ? [c / p, p] : null;
  }
  function drawTime(chart, pc, now) {
    var w = 560, h = CH.h, win = pc.window_seconds || 900, step = pc.slot_seconds || 30;
    chart.setAttribute("viewBox", "0 0 " + w + " " + h);
    chart.replaceChildren();
    var plot = gridY(chart, w, h), span = w - CH.left - CH.right - 90;
    var start = now - win;
    function xOf(at) { return CH.left + span * Math.max(0, Math.min(1, (at + step / 2 - start) / win)); }
    [[start, "\u2212" + Math.round(win / 60) + " min"], [now - win / 2, "\u2212" + Math.round(win / 120) + " min"], [now, "now"]].forEach(function (tick) {
      var t = svg("text", {x: xOf(tick[0] - step / 2).toFixed(1), y: h - 7, "text-anchor": "middle"});
      t.textContent = tick[1];
      chart.appendChild(t);
    });
    SERIES.forEach(function (s, k) {
      var pts = [];
      (pc.series || []).forEach(function (slot) {
        var r = seriesRatio(slot, s);
        if (r) pts.push([xOf(slot.at), CH.top + plot * (1 - Math.max(0, Math.min(1, r[0]))), r, slot.at]);
      });
      if (pts.length > 1) {
        chart.appendChild(svg("polyline", {points: pts.map(function (p) { return p[0].toFixed(1) + "," + p[1].toFixed(1); }).join(" ")},
          "line " + s[1]));
      }
      pts.forEach(function (p) {
        var dot = svg("circle", {cx: p[0].toFixed(1), cy: p[1].toFixed(1), r: 2.5, "data-series": s[0], "data-ratio": p[2][0]}, s[1]);
        titled(dot, s[0] + ": " + pct(p[2][0]) + " of " + Number(p[2][1]).toLocaleString() + " prompt tokens, " +
          new Date(p[3] * 1000).toLocaleTimeString());
        chart.appendChild(dot);
      });
      var ky = CH.top + 6 + k * 16, kx = w - 84;
      chart.appendChild(svg("line", {x1: kx, x2: kx + 14, y1: ky, y2: ky}, "key " + s[1]));
      var kt = svg("text", {x: kx + 19, y: ky + 3.5});
      kt.textContent = s[0];
      chart.appendChild(kt);
    });
  }
  // the panel shows once a response of the last 15 minutes reported its usage
  function renderCache(pc, now) {
    var box = document.getElementById("cache");
    var p = 0, c = 0, n = 0;
    ((pc && pc.by_turn) || []).forEach(function (b) { p += b.prompt_tokens || 0; c += b.cached_tokens || 0; n += b.reported_responses || 0; });
    box.hidden = !(p > 0);
    if (box.hidden) return;
    var sum = document.getElementById("cache-sum");
    sum.replaceChildren(el("b", null, pct(c / p)));
    sum.appendChild(document.createTextNode(" of " + tokens(p) + " prompt tokens cached, " + n + (n === 1 ? " response" : " responses")));
    if (pc.unknown_responses) sum.appendChild(document.createTextNode(" \u00b7 " + pc.unknown_responses + " without usage"));
    drawTurns(document.getElementById("chart-turns"), pc);
    drawTime(document.getElementById("chart-time"), pc, now);
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
    var cache = cacheEl(n.prompt_cache, false);
    if (cache) row.appendChild(cache);
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
    var treeCache = cacheEl(t.tree && t.tree.subtree_prompt_cache, true);
    if (treeCache) sum.appendChild(treeCache);
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
    // live_trees is a lower bound when the store's snapshot could not read every live session
    var trees = (d.live_trees_exact === false ? "at least " : "") + d.live_trees;
    document.getElementById("n-trees").textContent = trees;
    document.getElementById("n-flight").textContent = inFlight;
    document.title = "Sessions (" + d.live_sessions + " live)";
    renderCache(d.prompt_cache, d.generated_at);
    var shown = (d.trees || []).filter(function (t) { return !needle || matches(t.tree, needle); });
    if (d.truncated) {
      frag.appendChild(el("div", "note", "Showing the " + d.shown_trees + " most recently active of " + trees +
        " trees" + (d.trees.some(function (t) { return t.omitted; }) ? "; large trees are cut" : "") + "."));
    }
    if (!shown.length) {
      frag.appendChild(el("div", "empty", needle ? "No session matches the filter." : "No live sessions."));
    }
    shown.forEach(function (t) { frag.appendChild(treeEl(t, d.now, needle)); });
    treesEl.replaceChildren(frag);
  }

  // A bearer token for sidecars whose admin API needs one: /ui#token=<token> (the fragment never
  // leaves the browser); kept for this tab only. Typing it after the address later (which does
  // not reload the page) works too.
  var token = null;
  function readToken() {
    var m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
    if (!m) return false;
    token = decodeURIComponent(m[1]);
    try { sessionStorage.setItem("sidecar-token", token); } catch (e) {}
    history.replaceState(null, "", location.pathname + location.search);
    return true;
  }
  if (!readToken()) {
    try { token = sessionStorage.getItem("sidecar-token"); } catch (e) {}
  }

  function setStatus(text, cls) { statusEl.textContent = text; statusEl.className = cls || ""; }

  // 401 / 403: say which token is needed and how to give it, and wait for one (no polling).
  function needToken(status) {
    var page = location.origin + location.pathname;
    var box = el("div", "empty tokenhelp");
    if (status === 403) {
      box.appendChild(el("p", null, "This token may not open the live view: it needs an admin token " +
        "(an entry with admin: true in the sidecar's tokens file)."));
    } else {
      box.appendChild(el("p", null, token ? "The token given was refused (HTTP 401)." :
        "This sidecar's admin listener needs a token to show its sessions."));
    }
    box.appendChild(el("p", null, "Open this page with an admin token after #token= in the address:"));
    box.appendChild(el("code", null, page + "#token=<admin token>"));
    box.appendChild(el("p", "hint", "The token stays in this browser tab: the part after # is never sent to the sidecar."));
    treesEl.replaceChildren(box);
    last = null;
    if (token) { token = null; try { sessionStorage.removeItem("sidecar-token"); } catch (e) {} }
    setStatus(status === 403 ? "admin token needed" : "token needed", "error");
  }

  function tick() {
    timer = null;
    if (paused) return;
    var ctrl = new AbortController();
    var abort = setTimeout(function () { ctrl.abort(); }, 5000);
    var headers = token ? {"Authorization": "Bearer " + token} : {};
    var again = true;
    fetch("ui/data.json", {cache: "no-store", signal: ctrl.signal, headers: headers})
      .then(function (r) {
        if (r.status === 401 || r.status === 403) { again = false; needToken(r.status); return null; }
        if (!r.ok) throw new Error("HTTP " + r.status);
        return r.json();
      })
      .then(function (d) {
        if (d === null) return;
        last = d;
        render(d);
        setStatus("updated " + new Date().toLocaleTimeString(), "");
      })
      .catch(function (e) { setStatus("cannot reach the sidecar (" + (e && e.message || e) + ")", "error"); })
      .finally(function () { clearTimeout(abort); if (again && !paused) timer = setTimeout(tick, REFRESH_MS); });
  }

  window.addEventListener("hashchange", function () {
    if (!readToken()) return;
    if (timer) clearTimeout(timer);
    treesEl.replaceChildren(el("div", "empty", "Loading\u2026"));
    tick();
  });

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
