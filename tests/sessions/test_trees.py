"""``GET /v1/trees/{root}`` and the live view on a real sidecar: a live session stays reachable
from its tree when its ancestor's id is reused, deep and huge trees render with ``omitted``
markers, node timestamps are RFC 3339."""

from __future__ import annotations

import asyncio
import re
from datetime import datetime
from typing import Any

import aiohttp
import pytest

from sidecar.admin import views
from sidecar.admin.server import build_admin_app
from sidecar.admin.views import MAX_DEPTH, MAX_NODES, VIEWS_LOCK
from sidecar.lineage import VIEW_STEP
from tests.modes.wire import settled
from tests.sessions.support import fill, metrics_text, walk
from tests.upstream import RecordingUpstream

FINAL = {"X-Session-Final": "true"}
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


async def send(
    http: aiohttp.ClientSession, sc: Any, session: str, *, parent: str | None = None, final: bool = False
) -> None:
    headers = {"X-Correlation-ID": session, **(FINAL if final else {})}
    if parent is not None:
        headers["X-Parent-Session-ID"] = parent
    async with http.post(sc.proxy_url + "/v1/chat/completions", headers=headers, json={"messages": []}) as resp:
        assert resp.status == 200
        await resp.read()
    await settled(sc, session)


async def get_json(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as resp:
        return resp.status, await resp.json()


def gauge(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match is not None, name
    return float(match.group(1))


async def test_reused_root_id_keeps_its_live_child_reachable(upstream: RecordingUpstream, start_sidecar, http):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    await send(http, sc, "R")
    await send(http, sc, "C", parent="R")
    await send(http, sc, "R", final=True)  # R ends; held as C's ancestor
    await send(http, sc, "R", final=True)  # a new session R on the same id, ended at once
    assert (await get_json(http, f"{sc.admin_url}/v1/sessions/C"))[0] == 200
    status, tree = await get_json(http, f"{sc.admin_url}/v1/trees/R")
    assert status == 200, tree
    assert tree["session"] == "R" and tree["ended"] is True and tree["turns"] == 1  # the newer R
    assert [(c["session"], c["parent"], c["root"], c["ended"]) for c in tree["children"]] == [("C", "R", "R", False)]
    status, child_view = await get_json(http, f"{sc.admin_url}/v1/trees/C")
    assert status == 200 and child_view == tree
    status, data = await get_json(http, f"{sc.admin_url}/ui/data.json")
    assert status == 200
    assert [(t["root"], [n["session"] for n in walk(t["tree"])]) for t in data["trees"]] == [("R", ["R", "C"])]
    assert data["live_sessions"] == 1 and data["live_trees"] == 1
    text = await metrics_text(http, sc.admin_url)
    assert gauge(text, "sidecar_live_trees") == 1 and gauge(text, "sidecar_live_sessions") == 1
    # C's final turn ends the tree: nothing is left held
    await send(http, sc, "C", parent="R", final=True)
    assert (await get_json(http, f"{sc.admin_url}/v1/trees/R"))[0] == 404
    text = await metrics_text(http, sc.admin_url)
    assert gauge(text, "sidecar_live_trees") == 0 and gauge(text, "sidecar_live_sessions") == 0


async def test_deep_chain_renders_cut_with_markers_and_rfc3339_times(upstream: RecordingUpstream, start_sidecar, http):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    await send(http, sc, "d0")
    for i in range(1, 128):  # deeper than JSON encoders nest (two levels per tree level)
        await send(http, sc, f"d{i}", parent=f"d{i - 1}")
    status, tree = await get_json(http, f"{sc.admin_url}/v1/trees/d77")
    assert status == 200, tree
    chain = walk(tree)
    assert [n["session"] for n in chain] == [f"d{i}" for i in range(MAX_DEPTH + 1)]
    assert chain[-1]["children"] == [] and chain[-1]["omitted"] == 128 - MAX_DEPTH - 1
    assert all("omitted" not in n for n in chain[:-1])
    for n in chain:
        assert RFC3339.match(n["created_at"]) and RFC3339.match(n["last_active_at"])
        assert n["created_at"] <= n["last_active_at"] and n["root"] == "d0"
    _, node = await get_json(http, f"{sc.admin_url}/v1/sessions/d5")
    assert abs(_seconds(node["created_at"]) - _seconds(chain[5]["created_at"])) < 0.01
    status, data = await get_json(http, f"{sc.admin_url}/ui/data.json")
    (entry,) = data["trees"]
    assert entry["sessions"] == 128 and entry["omitted"] == 128 - MAX_DEPTH - 1
    assert len(walk(entry["tree"])) == MAX_DEPTH + 1


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


@pytest.fixture
def every_step_a_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Views yield the loop after each step of about ``VIEW_STEP`` sessions instead of after each
    ``SLICE_SECONDS`` of work: how many pauses a view makes then follows from its size, not from
    how fast the machine is (a fast one builds a few thousand sessions in one 2 ms slice)."""
    monkeypatch.setattr(views, "SLICE_SECONDS", 0.0)


async def _get_counting_ticks(http: aiohttp.ClientSession, url: str, building: asyncio.Lock) -> tuple[int, Any, int]:
    """GET ``url`` while a ticker shares the event loop with the admin listener; how many times
    the ticker ran while a view was being built (``building`` held)."""
    task = asyncio.ensure_future(get_json(http, url))
    ticks = 0
    while not task.done():
        ticks += building.locked()
        await asyncio.sleep(0)
    status, body = await task
    return status, body, ticks


async def test_views_of_a_100k_session_tree_are_cut_and_let_the_proxy_run(
    upstream: RecordingUpstream, start_sidecar, http, aiohttp_server, every_step_a_slice
):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers", sessions={"max_live_sessions": 200_000})
    fill(sc.router, 300, 99_699)
    # a second admin listener on the same router, to watch when its views are being built
    admin = build_admin_app(sc.router, sc.health, sc.metrics)
    base = str((await aiohttp_server(admin)).make_url(""))
    status, tree, ticks = await _get_counting_ticks(http, f"{base}/v1/trees/b17", admin[VIEWS_LOCK])
    assert status == 200 and tree["session"] == "big" and len(tree["children"]) == 300
    nodes = walk(tree)
    assert len(nodes) == MAX_NODES and sum(n.get("omitted", 0) for n in nodes) == 100_000 - MAX_NODES
    # built in steps of about VIEW_STEP sessions, other tasks of the loop running in between
    assert ticks >= MAX_NODES // VIEW_STEP, ticks
    status, data, ticks = await _get_counting_ticks(http, f"{base}/ui/data.json", admin[VIEWS_LOCK])
    assert status == 200 and data["trees"][0]["sessions"] == 100_000 and data["trees"][0]["omitted"] == 98_000
    assert ticks >= MAX_NODES // VIEW_STEP, ticks
    await send(http, sc, "b17", parent="a17")
    status, node = await get_json(http, f"{sc.admin_url}/v1/sessions/b17")
    assert status == 200 and node["turns"] == 2


async def test_views_of_many_api_sessions_without_requests_are_cut_and_let_the_proxy_run(
    upstream: RecordingUpstream, start_sidecar, http, aiohttp_server, every_step_a_slice
):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    # API sessions straight into the sidecar's table (as POST /v1/sessions makes them): a root
    # and 2,999 children, none with a request
    store = sc.router.store
    store.create(deployment="default", workspace=None, session_id="big")
    for i in range(2999):
        store.create(deployment="default", workspace=None, session_id=f"k{i}", parent="big", root="big")
    admin = build_admin_app(sc.router, sc.health, sc.metrics)
    base = str((await aiohttp_server(admin)).make_url(""))
    status, tree, ticks = await _get_counting_ticks(http, f"{base}/v1/trees/k17", admin[VIEWS_LOCK])
    assert status == 200 and tree["session"] == "big" and tree["omitted"] == 3000 - MAX_NODES
    assert len(walk(tree)) == MAX_NODES and not any(n["placeholder"] for n in walk(tree))
    # built in steps of about VIEW_STEP sessions, other tasks of the loop running in between
    assert ticks >= MAX_NODES // VIEW_STEP, ticks
    status, data, ticks = await _get_counting_ticks(http, f"{base}/ui/data.json", admin[VIEWS_LOCK])
    assert status == 200 and (data["live_sessions"], data["live_trees"]) == (3000, 1)
    (entry,) = data["trees"]
    assert (entry["sessions"], entry["live"], entry["omitted"]) == (3000, 3000, 3000 - MAX_NODES)
    assert len(walk(entry["tree"])) == MAX_NODES and data["truncated"] is True
    assert ticks >= MAX_NODES // VIEW_STEP, ticks
    await send(http, sc, "k17")
    status, node = await get_json(http, f"{sc.admin_url}/v1/sessions/k17")
    assert status == 200 and (node["turns"], node["root"]) == (1, "big")
