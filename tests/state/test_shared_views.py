"""The views of a fleet sharing a store, on real sockets and a real redis-server: a large tree is
read in steps under the views lock (the proxy runs between them), API sessions show the root of
their parent's tree from creation, the live view counts the fleet's trees, and every session has
one schema in every view."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from sidecar.admin.server import build_admin_app
from sidecar.admin.views import MAX_NODES, VIEWS_LOCK
from sidecar.lineage import VIEW_STEP
from tests.sessions.support import fill, walk
from tests.state.fleet import api, metric, post
from tests.waiting import wait_for


async def _get_watching(
    http: aiohttp.ClientSession, url: str, building: asyncio.Lock, sc: Any
) -> tuple[int, Any, int, float]:
    """GET ``url`` while a ticker shares the event loop with the admin listener: how many times
    it ran while the view was being built (``building`` held), and the most store commands
    answered between two of its turns then (what one uninterrupted stretch of the view read)."""
    task = asyncio.ensure_future(api(http, "GET", url))
    ticks = 0
    most = 0.0
    before = metric(sc, "sidecar_state_commands_total")
    while not task.done():
        now = metric(sc, "sidecar_state_commands_total")
        if building.locked():
            ticks += 1
            most = max(most, now - before)
        before = now
        await asyncio.sleep(0)
    status, body = await task
    return status, body, ticks, most


async def test_a_view_of_a_large_tree_on_the_store_is_read_in_steps_under_the_views_lock(
    upstream, replicas, http, aiohttp_server, redis_server
):
    # (a store slower than timeout_ms under load would take the replica off it: not what is tested)
    (a,) = await replicas(1, upstream=upstream.url, mode="dynamo_headers", state={"timeout_ms": 5000})
    fill(a.router, 100, 2399)
    await wait_for(lambda: redis_server.cli("ZCARD", replicas.prefix + "live").strip() == "2500", timeout=20)
    # a second admin listener on the same router, to watch when its views are being built
    admin = build_admin_app(a.router, a.health, a.metrics)
    base = str((await aiohttp_server(admin)).make_url(""))
    status, tree, ticks, most = await _get_watching(http, f"{base}/v1/trees/b17", admin[VIEWS_LOCK], a)
    assert status == 200 and tree["session"] == "big" and len(tree["children"]) == 100
    nodes = walk(tree)
    assert len(nodes) == MAX_NODES and sum(n.get("omitted", 0) for n in nodes) == 2500 - MAX_NODES
    # built under the views lock, a round trip of at most about VIEW_STEP reads at a time, the
    # loop running other tasks in between
    assert ticks >= MAX_NODES // VIEW_STEP, ticks
    assert 0 < most <= 2 * VIEW_STEP, most
    status, data, ticks, most = await _get_watching(http, f"{base}/ui/data.json", admin[VIEWS_LOCK], a)
    assert status == 200 and [t["root"] for t in data["trees"]] == ["big"]
    assert data["trees"][0]["omitted"] == 2500 - MAX_NODES and len(walk(data["trees"][0]["tree"])) == MAX_NODES
    assert ticks >= MAX_NODES // VIEW_STEP, ticks
    assert 0 < most <= 2 * VIEW_STEP, most
    assert (await post(http, a, "b17", parent="a17"))[0] == 200
    status, node = await api(http, "GET", f"{a.admin_url}/v1/sessions/b17")
    assert status == 200 and node["turns"] == 2
