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
    // live_trees is a lower bound when the store's snapshot could not read every live session
    var trees = (d.live_trees_exact === false ? "at least " : "") + d.live_trees;
    document.getElementById("n-trees").textContent = trees;
    document.getElementById("n-flight").textContent = inFlight;
    document.title = "Sessions (" + d.live_sessions + " live)";
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
