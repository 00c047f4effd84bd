"""Live session view: ``/ui/data.json`` after a real workload, its bounds, and the page drawn by
headless Chromium (``deploy`` marker; Chromium from scripts/install_browser.sh)."""

from __future__ import annotations

import asyncio
import contextlib
import html.parser
import os
import re
import shutil
import struct
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar.admin.ui import MAX_DEPTH, MAX_NODES, STATIC, add_ui_routes, snapshot, snapshot_steps, static_files
from sidecar.context import TurnOutcome
from sidecar.lineage import VIEW_STEP, SessionTree

ROOT_A = "agent-run-2f9c1e7a-77d4-4c1b-9a0e-planner"  # long: drawn truncated, full id on hover
XSS = "<img src=x onerror=\"document.title='pwned'\">"  # ids are client-supplied


# -- workload ------------------------------------------------------------------------------------


async def _send(
    s: aiohttp.ClientSession,
    proxy: str,
    session: str,
    *,
    parent: str | None = None,
    root: str | None = None,
    final: bool = False,
    path: str = "/v1/chat/completions",
) -> None:
    headers = {"X-Correlation-ID": session}
    if parent is not None:
        headers["X-Parent-Session-ID"] = parent
    if root is not None:
        headers["X-Root-Session-ID"] = root
    if final:
        headers["X-Session-Final"] = "true"
    async with s.post(f"{proxy}{path}", headers=headers, json={"messages": []}) as resp:
        assert resp.status == 200
        await resp.read()


@contextlib.asynccontextmanager
async def workload(sc: Any, upstream: Any) -> AsyncIterator[None]:
    """Three trees, oldest activity first: C (placeholder root), B (XSS id, child, root-hinted
    session), A (children, an ended parent held by its child, a final turn still in flight)."""
    proxy = sc.proxy_url
    async with aiohttp.ClientSession() as s:
        await _send(s, proxy, "c-child", parent="c-ghost")
        await _send(s, proxy, XSS)
        await _send(s, proxy, "b-child", parent=XSS)
        await _send(s, proxy, "b-hinted", root=XSS)
        for _ in range(2):
            await _send(s, proxy, ROOT_A)
        for _ in range(3):
            await _send(s, proxy, "worker-a1", parent=ROOT_A)
        await _send(s, proxy, "worker-a2", parent=ROOT_A)
        await _send(s, proxy, "tool-a2-x", parent="worker-a2")
        await _send(s, proxy, "worker-a2", parent=ROOT_A, final=True)  # ends; held by tool-a2-x
        seen = len(upstream.received)
        slow = asyncio.create_task(_send(s, proxy, "worker-a3", parent=ROOT_A, final=True, path="/slow?delay=50"))
        try:
            for _ in range(200):
                if len(upstream.received) > seen:
                    break
                await asyncio.sleep(0.01)
            assert len(upstream.received) > seen
            yield
        finally:
            slow.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await slow


@contextlib.asynccontextmanager
async def ui_base(sc: Any) -> AsyncIterator[str]:
    """The admin URL when it serves /ui; else a separate app with the UI routes on the same tree."""
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.admin_url}/ui") as resp:
            wired = resp.status == 200
    if wired:
        yield sc.admin_url
        return
    app = web.Application()
    add_ui_routes(app, lambda: sc.router.tree)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _walk(node: dict[str, Any]) -> list[dict[str, Any]]:
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(reversed(n["children"]))
    return out


def _shape(node: dict[str, Any]) -> Any:
    return (node["session"], [_shape(c) for c in node["children"]])


EXPECTED_TREES = [
    (ROOT_A, [("worker-a1", []), ("worker-a2", [("tool-a2-x", [])]), ("worker-a3", [])]),
    (XSS, [("b-child", []), ("b-hinted", [])]),
    ("c-ghost", [("c-child", [])]),
]
NODE_KEYS = {
    "session",
    "parent",
    "root",
    "deployment",
    "created_at",
    "last_active_at",
    "turns",
    "in_flight",
    "final_turn_seen",
    "ended",
    "end_reason",
    "placeholder",
    "children",
}


# -- data.json through a real sidecar ------------------------------------------------------------


async def test_data_json_after_workload(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    async with workload(sc, upstream), ui_base(sc) as base, aiohttp.ClientSession() as s:
        async with s.get(f"{base}/ui/data.json") as resp:
            assert resp.status == 200
            assert resp.content_type == "application/json"
            assert resp.headers["Cache-Control"] == "no-store"
            data = await resp.json()
        async with s.get(f"{base}/ui/data.json?limit=2") as resp:
            two = await resp.json()

    assert data["live_sessions"] == 9  # every held node but the ended worker-a2
    assert data["live_trees"] == 3 and data["live_trees_exact"] is True
    assert data["limit"] == 200 and data["shown_trees"] == 3 and data["truncated"] is False
    assert isinstance(data["now"], float) and isinstance(data["generated_at"], float)
    assert [(t["root"], _shape(t["tree"])[1]) for t in data["trees"]] == EXPECTED_TREES  # newest first
    for t in data["trees"]:
        assert set(t) == {"root", "last_active_at", "sessions", "live", "in_flight", "final", "omitted", "tree"}
        assert t["omitted"] == 0
        assert t["last_active_at"] == max(n["last_active_at"] for n in _walk(t["tree"])) <= data["now"]
        for n in _walk(t["tree"]):
            assert NODE_KEYS <= set(n)
            assert n["root"] == t["root"]

    a, b, c = data["trees"]
    assert (a["sessions"], a["live"], a["in_flight"], a["final"]) == (5, 4, 1, False)
    assert (b["sessions"], b["live"], b["in_flight"], b["final"]) == (3, 3, 0, False)
    assert (c["sessions"], c["live"], c["in_flight"], c["final"]) == (2, 1, 0, False)
    nodes = {n["session"]: n for t in data["trees"] for n in _walk(t["tree"])}
    assert nodes[ROOT_A]["turns"] == 2 and nodes[ROOT_A]["parent"] is None
    assert nodes["worker-a1"]["turns"] == 3 and nodes["worker-a1"]["parent"] == ROOT_A
    assert nodes["worker-a2"]["ended"] is True and nodes["worker-a2"]["end_reason"] == "final_turn_completed"
    assert nodes["tool-a2-x"]["parent"] == "worker-a2" and nodes["tool-a2-x"]["ended"] is False
    a3 = nodes["worker-a3"]
    assert (a3["in_flight"], a3["final_turn_seen"], a3["ended"]) == (1, True, False)
    assert nodes["b-hinted"]["parent"] is None and nodes["b-hinted"]["root"] == XSS  # joined by root hint
    assert nodes["c-ghost"]["placeholder"] is True and nodes["c-ghost"]["turns"] == 0

    assert two["limit"] == 2 and two["truncated"] is True
    assert [t["root"] for t in two["trees"]] == [ROOT_A, XSS]


# -- bounds, ordering and the page itself (no sidecar) -------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _one(tree: SessionTree, session: str, *, worker: str | None = None, **kw: Any) -> None:
    kw.setdefault("parent", None)
    turn, _ = tree.begin(
        session, root_hint=kw.pop("root_hint", None), final=kw.pop("final", False), deployment="default", **kw
    )
    if worker is not None:
        tree.record_worker(turn, worker)
    tree.finish(turn, TurnOutcome.COMPLETED)


async def test_order_is_by_newest_activity_in_the_tree():
    clock = Clock()
    tree = SessionTree(clock=clock)
    for root in ["r0", "r1", "r2"]:
        clock.t += 1
        _one(tree, root)
    clock.t += 1
    _one(tree, "r0-kid", parent="r0")  # a child's turn makes r0's tree the newest
    snap = await snapshot(tree)
    assert [t["root"] for t in snap["trees"]] == ["r0", "r2", "r1"]
    assert snap["now"] == clock.t and snap["trees"][0]["last_active_at"] == clock.t
    assert [t["root"] for t in (await snapshot(tree, limit=1))["trees"]] == ["r0"]


async def test_tree_final_when_every_live_session_saw_its_final_turn():
    tree = SessionTree(clock=Clock())
    _one(tree, "root")
    turn, _ = tree.begin("kid", parent="root", root_hint=None, final=True, deployment="default")
    assert (await snapshot(tree))["trees"][0]["final"] is False
    tree.begin("root", parent=None, root_hint=None, final=True, deployment="default")
    assert (await snapshot(tree))["trees"][0]["final"] is True
    tree.finish(turn, TurnOutcome.COMPLETED)


async def test_node_budget_and_depth_cut_are_reported():
    clock = Clock()
    tree = SessionTree(clock=clock)
    _one(tree, "wide")
    for i in range(30):
        _one(tree, f"w{i:02}", parent="wide")
    clock.t += 1
    _one(tree, "deep0")
    for i in range(1, 3000):  # far deeper than JSON encoders or browsers nest comfortably
        _one(tree, f"deep{i}", parent=f"deep{i - 1}")
    snap = await snapshot(tree, max_nodes=20, max_depth=10)
    by_root = {t["root"]: t for t in snap["trees"]}
    deep, wide = by_root["deep0"], by_root["wide"]
    assert snap["truncated"] is True
    shown = sum(len(_walk(t["tree"])) for t in snap["trees"])
    assert shown == 20 and [t["root"] for t in snap["trees"]] == ["deep0", "wide"]
    assert len(_walk(deep["tree"])) == 11 and len(_walk(wide["tree"])) == 9  # depth 10 cut, then budget
    assert deep["sessions"] == 3000 and wide["sessions"] == 31
    for t in (deep, wide):
        assert len(_walk(t["tree"])) + t["omitted"] == t["sessions"]
        assert t["omitted"] == sum(n.get("omitted", 0) for n in _walk(t["tree"]))
    # every shown tree keeps its root, even past the budget
    tight = await snapshot(tree, max_nodes=5, max_depth=10)
    assert [len(_walk(t["tree"])) for t in tight["trees"]] == [5, 1]
    # defaults: a 3000-deep chain is cut at MAX_DEPTH and serializes
    full = await snapshot(tree)
    chain = next(t for t in full["trees"] if t["root"] == "deep0")
    assert 1 < len(_walk(chain["tree"])) < 100 and chain["omitted"] == 3000 - len(_walk(chain["tree"]))


def _pauses(tree: SessionTree) -> tuple[dict[str, Any], int]:
    steps = snapshot_steps(tree)
    pauses = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, pauses
        pauses += 1


def test_a_snapshot_of_20k_sessions_lets_the_loop_run_every_few_hundred_nodes():
    """A snapshot walks every held node once (the trees' activity): in slices of VIEW_STEP nodes,
    so a large tree never holds the event loop for the whole walk."""
    tree = SessionTree(clock=Clock())
    for r in range(10):  # few trees: their own pauses (one each) cannot make up the count below
        _one(tree, f"root{r}")
        for k in range(1999):
            _one(tree, f"root{r}-k{k}", parent=f"root{r}")
    snap, pauses = _pauses(tree)
    assert snap["live_sessions"] == 20_000 and snap["shown_trees"] == 10
    # the drawn nodes (at most MAX_NODES) and the trees pause too, far fewer times than the walk
    assert 10 + MAX_NODES // VIEW_STEP < 20_000 // VIEW_STEP <= pauses, pauses


def _huge_tree(clock: Clock | None = None) -> SessionTree:
    """100,000 sessions in one tree: a root, 300 children, 99,699 grandchildren."""
    tree = SessionTree(clock=clock or Clock(), max_live=200_000)
    _one(tree, "root")
    for i in range(300):
        _one(tree, f"a{i}", parent="root")
    for i in range(99_699):
        _one(tree, f"b{i}", parent=f"a{i % 300}")
    return tree


async def _ticks_while(work: Any) -> tuple[Any, int]:
    """Run ``work`` as a task; how many times a ticker sharing the loop ran before it finished."""
    task = asyncio.ensure_future(work)
    ticks = 0
    while not task.done():
        ticks += 1
        await asyncio.sleep(0)
    return await task, ticks


async def test_snapshot_of_a_huge_tree_is_cut_and_lets_the_loop_run():
    clock = Clock()
    tree = _huge_tree(clock)
    clock.t += 1
    for i in range(10):
        _one(tree, f"lone{i}")
    snap, ticks = await _ticks_while(snapshot(tree))
    assert snap["live_sessions"] == 100_010 and snap["live_trees"] == 11 and snap["truncated"] is True
    assert [t["root"] for t in snap["trees"]] == [f"lone{i}" for i in range(9, -1, -1)] + ["root"]
    big = snap["trees"][-1]
    assert (big["sessions"], big["live"], big["in_flight"], big["final"]) == (100_000, 100_000, 0, False)
    nodes = _walk(big["tree"])
    assert len(nodes) == MAX_NODES - 10 and len(_walk(snap["trees"][0]["tree"])) == 1
    assert big["omitted"] == 100_000 - len(nodes) == sum(n.get("omitted", 0) for n in nodes)
    assert ticks >= 5, ticks  # the snapshot was built in slices, the loop ran in between


def test_snapshot_pauses_between_small_trees_too():
    tree = SessionTree(clock=Clock())
    for r in range(300):
        _one(tree, f"r{r}")
        for k in range(4):
            _one(tree, f"r{r}-{k}", parent=f"r{r}")
    steps = snapshot_steps(tree, limit=250)
    pauses = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            snap = done.value
            break
        pauses += 1
    assert snap["shown_trees"] == 250 and pauses >= 250  # no tree is big enough to pause on its own


async def test_snapshot_of_a_20k_deep_placeholder_chain():
    clock = Clock()
    tree = SessionTree(clock=clock)
    _one(tree, "leaf", parent="p1")
    for i in range(1, 20_000):  # each placeholder's own request names the next one: one long root-link chain
        clock.t += 0.001
        _one(tree, f"p{i}", parent=f"p{i + 1}")
    snap = await snapshot(tree)
    (entry,) = snap["trees"]
    assert entry["root"] == "p20000" and entry["sessions"] == 20_001 and entry["live"] == 20_000
    chain = _walk(entry["tree"])
    assert len(chain) == MAX_DEPTH + 1 and chain[-1]["omitted"] == entry["omitted"] == 20_001 - MAX_DEPTH - 1
    assert entry["last_active_at"] == clock.t and chain[0]["placeholder"] is True


async def test_page_and_limits(aiohttp_client):
    tree = SessionTree(clock=Clock())
    _one(tree, "only")
    app = web.Application()
    add_ui_routes(app, lambda: tree)
    client = await aiohttp_client(app)
    files = static_files()
    assert set(files) == {"ui.html", "ui.css", "ui.js"}
    for name, (path, content_type) in STATIC.items():
        resp = await client.get(path)
        assert resp.status == 200 and (resp.content_type, resp.charset) == (content_type, "utf-8"), name
        assert await resp.read() == files[name]
        assert resp.headers["Cache-Control"] == "no-store" and resp.headers["X-Content-Type-Options"] == "nosniff"
        policy = dict(d.strip().split(" ", 1) for d in resp.headers["Content-Security-Policy"].split(";"))
        assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
        # script and style from this listener only: nothing inline runs
        assert policy["script-src"] == "'self'" and policy["style-src"] == "'self'"
        assert "unsafe" not in resp.headers["Content-Security-Policy"]
    page, css, js = (files[n].decode() for n in ("ui.html", "ui.css", "ui.js"))
    # its only subresources are its own files, by relative URL (like ui/data.json: the page works
    # behind a path prefix), and nothing inline that the policy would block
    assert re.findall(r'<(?:link|script)\b[^>]*\b(?:href|src)="([^"]*)"', page) == [
        "ui/static/ui.css",
        "ui/static/ui.js",
    ]
    assert page.count("<script") == page.count("<script src=") == 1 and "</script>" in page
    assert "<style" not in page and not re.search(r"\s(?:style|on[a-z]+)=", page)
    assert 'fetch("ui/data.json"' in js
    # self-contained: no external resources, and ids only ever reach the DOM as text
    assert not re.search(r"https?://|//cdn|@import|url\(", page + css + js)
    assert "innerHTML" not in js and "outerHTML" not in js and "insertAdjacentHTML" not in js
    assert "document.write" not in js and "textContent" in js
    resp = await client.get("/ui/", allow_redirects=False)
    assert resp.status == 302
    first = await (await client.get("/ui/data.json")).json()
    again = await (await client.get("/ui/data.json")).json()
    assert again["generated_at"] == first["generated_at"]  # several pages polling cost one walk
    for query, limit in (("", 200), ("?limit=0", 1), ("?limit=99999", 1000), ("?limit=x", 200)):
        resp = await client.get(f"/ui/data.json{query}")
        assert (await resp.json())["limit"] == limit


# -- headless Chromium ---------------------------------------------------------------------------


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    msg = "chromium is not installed (scripts/install_browser.sh)"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


async def _run_chromium(binary: str, profile: Path, *args: str) -> bytes:
    proc = await asyncio.create_subprocess_exec(
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--window-size=1200,800",
        "--virtual-time-budget=5000",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 40)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out


class _Dom(html.parser.HTMLParser):
    """Nesting of the rendered ``li.node`` elements (by their data-session) and the img tags."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, str | None]] = []
        self.parent_of: dict[str, str | None] = {}
        self.titles: set[str] = set()
        self.classes: dict[str, str] = {}
        self.imgs = 0
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "img":
            self.imgs += 1
        if a.get("title"):
            self.titles.add(a["title"] or "")
        session = a.get("data-session") if tag == "li" else None
        if session is not None:
            above = [s for t, s in self.stack if s is not None]
            self.parent_of[session] = above[-1] if above else None
            self.classes[session] = a.get("class") or ""
        if tag not in ("br", "meta", "input", "img", "link"):
            self.stack.append((tag, session))

    def handle_endtag(self, tag: str) -> None:
        while self.stack:
            if self.stack.pop()[0] == tag:
                break

    def handle_data(self, data: str) -> None:
        self.text.append(data)


@pytest.mark.deploy
@pytest.mark.parametrize("engine", ["aiohttp"])
async def test_browser_draws_live_tree(upstream, start_sidecar, tmp_path):
    binary = _chromium()
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    async with workload(sc, upstream), ui_base(sc) as base:
        url = f"{base}/ui"
        started = time.monotonic()
        dom_html = (await _run_chromium(binary, tmp_path / "profile-dom", "--dump-dom", url)).decode()
        png_path = tmp_path / "ui.png"
        await _run_chromium(binary, tmp_path / "profile-shot", f"--screenshot={png_path}", url)
        browser_s = time.monotonic() - started
    if os.environ.get("SIDECAR_UI_SCREENSHOT"):  # keep a copy to look at
        shutil.copy(png_path, os.environ["SIDECAR_UI_SCREENSHOT"])

    dom = _Dom()
    dom.feed(dom_html)
    # The JS ran: every session is drawn, nested exactly as the lineage.
    assert dom.parent_of == {
        ROOT_A: None,
        "worker-a1": ROOT_A,
        "worker-a2": ROOT_A,
        "tool-a2-x": "worker-a2",
        "worker-a3": ROOT_A,
        XSS: None,
        "b-child": XSS,
        "b-hinted": XSS,
        "c-ghost": None,
        "c-child": "c-ghost",
    }
    assert ROOT_A in dom.titles and ROOT_A not in "".join(dom.text)  # truncated, full id on hover
    assert "ended" in dom.classes["worker-a2"] and "inflight" in dom.classes["worker-a3"]
    assert "placeholder" in dom.classes["c-ghost"] and "active" in dom.classes["worker-a1"]
    text = " ".join(dom.text)
    assert "final turn completed" in text and "final turn seen" in text and "via root hint" in text
    # The client-supplied id is text, never markup: no <img> element, its handler never ran.
    assert dom.imgs == 0 and XSS in dom.titles and XSS[:12] in text
    assert re.search(r"<title>Sessions \(9 live\)</title>", dom_html)

    width, height, pixels = read_png(png_path.read_bytes())
    assert (width, height) == (1200, 800)
    # the stylesheet applied (served as a file under the page's policy): its background, not white
    assert _assert_drawn(width, height, pixels) == bytes.fromhex("f6f6f3")
    assert browser_s < 40


# -- a minimal PNG reader (8-bit RGB/RGBA, non-interlaced: what Chromium writes) ----------------


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and one RGB byte row per scanline."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunk = data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat.append(chunk)
        elif kind == b"IEND":
            break
    assert header is not None
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(b"".join(idat))
    stride = width * bpp
    prev = bytearray(stride)
    rows = []
    for y in range(height):
        start = y * (stride + 1)
        ftype = raw[start]
        line = bytearray(raw[start + 1 : start + 1 + stride])
        if ftype == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 255
        elif ftype == 2:
            line = bytearray((a + b) & 255 for a, b in zip(line, prev))
        elif ftype == 3:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 255
        elif ftype == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b = prev[i]
                c = prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        else:
            assert ftype == 0, ftype
        prev = line
        rows.append(bytes(line) if bpp == 3 else bytes(b for i, b in enumerate(line) if i % 4 != 3))
    return width, height, rows


def _assert_drawn(width: int, height: int, rows: list[bytes]) -> bytes:
    """Light page, many colours, dark text on many lines, tree rows indented at several depths;
    returns the background colour (RGB)."""
    colours: dict[bytes, int] = {}
    text_lines = 0
    first_ink: set[int] = set()
    for y in range(0, height, 2):
        row = rows[y]
        dark_x = [x for x in range(0, width, 2) if sum(row[3 * x : 3 * x + 3]) < 300]
        if dark_x:
            text_lines += 1
            first_ink.add(dark_x[0] // 8)
        for x in range(0, width, 3):
            px = row[3 * x : 3 * x + 3]
            colours[px] = colours.get(px, 0) + 1
    background, count = max(colours.items(), key=lambda kv: kv[1])
    assert sum(background) > 3 * 200, f"background not light: {background!r}"
    assert count < sum(colours.values()) * 0.97, "page is (almost) a single colour"
    assert len(colours) >= 32, f"only {len(colours)} colours"
    assert text_lines >= 60, f"dark text on only {text_lines} sampled lines"
    assert len(first_ink) >= 3, "no indentation"
    return background


@pytest.mark.deploy
async def test_browser_draws_worker_history(tmp_path):
    binary = _chromium()
    tree = SessionTree()
    for worker in ["decode-0"] * 3 + ["decode-1"] * 2:
        _one(tree, "planner", worker=worker)
    _one(tree, "coder", parent="planner", worker="decode-2")
    _one(tree, "reviewer", parent="planner")
    app = web.Application()
    add_ui_routes(app, lambda: tree)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/ui"
        dom_html = (await _run_chromium(binary, tmp_path / "profile", "--dump-dom", url)).decode()
        if os.environ.get("SIDECAR_UI_SCREENSHOT"):
            shot = Path(os.environ["SIDECAR_UI_SCREENSHOT"]).with_suffix(".workers.png")
            await _run_chromium(binary, tmp_path / "profile2", f"--screenshot={shot}", url)
    finally:
        await runner.cleanup()
    dom = _Dom()
    dom.feed(dom_html)
    assert dom.parent_of == {"planner": None, "coder": "planner", "reviewer": "planner"}
    assert "worker per run of turns: decode-0 \u00d73 \u2192 decode-1 \u00d72" in dom.titles
    assert "worker per run of turns: decode-2 \u00d71" in dom.titles
    row = re.search(r'data-session="planner".*?</div>', dom_html, re.S)
    assert row is not None
    text = re.sub(r"<[^>]+>", " ", row.group(0))
    assert re.search(r"decode-0\s+×3\s+→\s+decode-1\s+×2", text), text
    assert re.search(r"affinity\s+first\s+1\s+·\s+same_worker\s+3\s+·\s+moved\s+1", text), text
    assert 'class="w moved"' in row.group(0)


async def with_tokens_and_a_session(upstream: Any, start_sidecar: Any, tmp_path: Path) -> Any:
    """A sidecar with a tokens file (a workspace token and an admin token) that has proxied one
    request of the session ``secret-session``."""
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(
        "tokens:\n  - {token: ws-a-token-0123456789, workspace: ws-a}\n  - {token: admin-token-0123456789, admin: true}\n"
    )
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers", admin_tokens_file=str(tokens))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.proxy_url}/x", headers={"X-Correlation-ID": "secret-session"}) as resp:
            assert resp.status == 200
    return sc


async def test_live_view_data_needs_an_admin_token_when_tokens_are_configured(upstream, start_sidecar, tmp_path):
    sc = await with_tokens_and_a_session(upstream, start_sidecar, tmp_path)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.admin_url}/ui") as resp:
            assert resp.status == 200  # the page holds no data
        async with s.get(f"{sc.admin_url}/ui/data.json") as resp:
            assert resp.status == 401
            assert "secret-session" not in await resp.text()
        async with s.get(
            f"{sc.admin_url}/ui/data.json", headers={"Authorization": "Bearer ws-a-token-0123456789"}
        ) as resp:
            assert resp.status == 403
            assert (await resp.json())["error"]["type"] == "forbidden"
        async with s.get(
            f"{sc.admin_url}/ui/data.json", headers={"Authorization": "Bearer admin-token-0123456789"}
        ) as resp:
            assert resp.status == 200
            assert "secret-session" in await resp.text()


def _text(dom_html: str) -> str:
    dom = _Dom()
    dom.feed(dom_html)
    return " ".join(" ".join(dom.text).split())


@pytest.mark.deploy
@pytest.mark.parametrize("engine", ["aiohttp"])
async def test_browser_without_the_token_says_one_is_needed_and_how_to_give_it(upstream, start_sidecar, tmp_path):
    """With a tokens file, /ui opened without a token (or with one that cannot see the view) says
    so and shows the #token= form, instead of "cannot reach the sidecar" over "Loading..."."""
    binary = _chromium()
    sc = await with_tokens_and_a_session(upstream, start_sidecar, tmp_path)
    page = f"{sc.admin_url}/ui"

    async def shown(url: str, name: str) -> str:
        return (await _run_chromium(binary, tmp_path / name, "--dump-dom", url)).decode()

    how = f"Open this page with an admin token after #token= in the address: {page}#token=<admin token>"
    for name, url, first in [
        ("none", page, "This sidecar's admin listener needs a token to show its sessions."),
        ("wrong", f"{page}#token=not-a-token-0123456789", "The token given was refused (HTTP 401)."),
        (
            "workspace",
            f"{page}#token=ws-a-token-0123456789",
            "This token may not open the live view: it needs an admin token (an entry with admin: true in the "
            "sidecar's tokens file).",
        ),
    ]:
        text = _text(await shown(url, name))
        assert f"{first} {how}" in text, (name, text)
        assert "the part after # is never sent to the sidecar" in text
        assert "Loading" not in text and "cannot reach the sidecar" not in text
        assert "secret-session" not in text
    text = _text(await shown(f"{page}#token=admin-token-0123456789", "admin"))
    assert "secret-session" in text and "needs a token" not in text
    # The same page, drawn: the help is on screen below the header, centred, in dark text.
    png_path = tmp_path / "token.png"
    await _run_chromium(binary, tmp_path / "shot", f"--screenshot={png_path}", page)
    width, height, rows = read_png(png_path.read_bytes())
    assert (width, height) == (1200, 800)
    ink = [y for y in range(90, 240) if any(sum(rows[y][3 * x : 3 * x + 3]) < 300 for x in range(300, 900))]
    assert len(ink) >= 30, f"dark text on {len(ink)} lines of the help's band"
    assert rows[400][3 * 600 : 3 * 600 + 3] == bytes.fromhex("f6f6f3")  # the stylesheet's background


class _Charts(html.parser.HTMLParser):
    """The prompt-cache panel as drawn: the bars and points of its SVG charts (their data
    attributes), the cache tags of the tree rows."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.chart: str | None = None
        self.bars: dict[str, str] = {}  # turn bucket -> ratio drawn
        self.points: list[tuple[str, str]] = []  # (series, ratio)
        self.tree_ratio: list[str] = []
        self.hidden_panel = True
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "section" and a.get("id") == "cache":
            self.hidden_panel = "hidden" in a
        if tag == "svg" and a.get("id", "").startswith("chart-"):
            self.chart = a["id"]
        if tag == "rect" and self.chart == "chart-turns" and a.get("data-turn"):
            self.bars[a["data-turn"] or ""] = a.get("data-ratio") or ""
        if tag == "circle" and self.chart == "chart-time":
            self.points.append((a.get("data-series") or "", a.get("data-ratio") or ""))
        if tag == "span" and "cacheratio" in (a.get("class") or ""):
            self.tree_ratio.append(a.get("data-cached-ratio") or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self.chart = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)


# The chart workload: a tree of two sessions, each turn's (prompt, cached) as its response
# reported it (None: a response without usage).
CHART_TURNS: list[tuple[str, str | None, tuple[int, int] | None]] = [
    ("chart-main", None, (800, 0)),
    ("chart-main", None, (900, 768)),
    ("chart-main", None, (1000, 896)),
    ("chart-main", None, (1100, 992)),
    ("chart-sub", "chart-main", (200, 0)),
    ("chart-sub", "chart-main", (300, 160)),
    ("chart-sub", "chart-main", None),
]


def _chart_stream(counts: tuple[int, int] | None) -> bytes:
    from tests import usage_samples as samples

    return samples.chat_stream(None if counts is None else samples.chat_usage(*counts))


@pytest.mark.deploy
@pytest.mark.parametrize("engine", ["aiohttp"])
async def test_browser_draws_the_prompt_cache_charts(upstream, start_sidecar, tmp_path):
    """Turns of a tree whose responses reported usage (as the engines hand it to the router): the
    page draws the cached ratio by turn and over time, and each tree's and session's ratio."""
    from tests.usage_support import play_turn

    binary = _chromium()
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    for session, parent, counts in CHART_TURNS:
        await play_turn(sc.router, session, _chart_stream(counts), parent=parent)
    await _check_charts(binary, f"{sc.admin_url}/ui", tmp_path)


@pytest.mark.deploy
async def test_browser_draws_the_prompt_cache_charts_of_real_traffic(raw_upstream, start_sidecar, tmp_path):
    """The same tree's turns through the proxy, on each engine: an upstream streams each answer
    (chunked, one event per chunk) with the usage it reports; the engine reads it from the relayed
    body and the page draws what it counted."""
    from tests import usage_samples as samples
    from tests.engine import RawMessage
    from tests.modes.wire import settled

    answers = [samples.chunked_by_event(_chart_stream(counts)) for _, _, counts in CHART_TURNS]

    async def answer(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(answers.pop(0))
        await writer.drain()
        return True

    binary = _chromium()
    up = await raw_upstream({"/v1/chat/completions": answer})
    sc = await start_sidecar(upstream=up.url, mode="dynamo_headers")
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        for session, parent, counts in CHART_TURNS:
            headers = {"X-Correlation-ID": session}
            if parent is not None:
                headers["X-Parent-Session-ID"] = parent
            async with http.post(f"{sc.proxy_url}/v1/chat/completions", headers=headers, json={"stream": True}) as resp:
                assert resp.status == 200
                assert await resp.read() == _chart_stream(counts)  # relayed byte for byte
            await settled(sc, session)
    assert answers == []
    await _check_charts(binary, f"{sc.admin_url}/ui", tmp_path)


async def _check_charts(binary: str, url: str, tmp_path: Path) -> None:
    """The page at ``url`` draws :data:`CHART_TURNS`: the cached ratio by turn and over time,
    the tree's and each session's ratio, in the DOM and on screen."""
    dom_html = (await _run_chromium(binary, tmp_path / "profile-dom", "--dump-dom", url)).decode()
    png_path = tmp_path / "cache.png"
    await _run_chromium(binary, tmp_path / "profile-shot", f"--screenshot={png_path}", url)
    if os.environ.get("SIDECAR_UI_SCREENSHOT"):
        shutil.copy(png_path, Path(os.environ["SIDECAR_UI_SCREENSHOT"]).with_suffix(".cache.png"))

    charts = _Charts()
    charts.feed(dom_html)
    assert not charts.hidden_panel
    # by turn: turn 1 (800 + 200 prompt, nothing cached), turn 2 (768 + 160 of 900 + 300), turns 3-5
    assert {turn: float(r) for turn, r in charts.bars.items() if r} == {
        "1": 0.0,
        "2": pytest.approx(928 / 1200),
        "3-5": pytest.approx(1888 / 2100),
    }
    assert charts.bars["6-10"] == charts.bars["11+"] == ""  # nothing there: no bar
    # over time: this minute's point of each series
    drawn = {series: float(r) for series, r in charts.points}
    assert drawn == {
        "all turns": pytest.approx(2816 / 4300),
        "turn 1": 0.0,
        "turn 2 on": pytest.approx(2816 / 3300),
    }
    assert [float(r) for r in charts.tree_ratio] == [pytest.approx(2816 / 4300)]  # the tree's, in its head
    text = " ".join(" ".join(charts.text).split())
    assert "65% of 4.3k prompt tokens cached, 6 responses · 1 without usage" in text
    assert "cache 70%" in text and "cache 32%" in text  # each session's own: 2656 / 3800, 160 / 500

    width, height, rows = read_png(png_path.read_bytes())
    green = bytes.fromhex("1a7f37")  # the bars' colour (ui.css --green): drawn
    assert sum(row[3 * x : 3 * x + 3] == green for row in rows[:400] for x in range(0, width, 2)) > 200
