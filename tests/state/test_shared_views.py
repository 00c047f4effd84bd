"""The views of a fleet sharing a store, on real sockets and a real redis-server: a large tree is
read in steps under the views lock (the proxy runs between them), API sessions show the root of
their parent's tree from creation, the live view counts the fleet's trees, and every session has
one schema in every view."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import pytest

from sidecar.admin.server import build_admin_app
from sidecar.admin.views import MAX_NODES, VIEWS_LOCK
from sidecar.lineage import VIEW_STEP
from sidecar.state.views import LIVE_READ
from tests.sessions.support import Api, fetch_spec, fill, walk
from tests.state.fleet import api, metric, post
from tests.ui.test_ui import _chromium, _Dom, _run_chromium
from tests.waiting import eventually, wait_for


@pytest.fixture(params=["memory", "store"])
def fleet(request: pytest.FixtureRequest, engine: str) -> Any:
    """``await fleet(upstream=url, **config_keys)``: the sidecars of one store, of the engine
    under test: one with the memory store, or two replicas sharing a redis-server."""
    if request.param == "memory":
        start = request.getfixturevalue("start_sidecar")

        async def one(**keys: Any) -> list[Any]:
            return [await start(**keys)]

        return one
    replicas = request.getfixturevalue("replicas")

    async def two(**keys: Any) -> list[Any]:
        return list(await replicas(2, **keys))

    return two


async def create(http: aiohttp.ClientSession, sc: Any, session: str, parent: str | None = None) -> dict[str, Any]:
    body = {"deployment": "default", "session_id": session, **({"parent": parent} if parent else {})}
    status, made = await api(http, "POST", sc.admin_url + "/v1/sessions", body)
    assert status == 201, made
    return made


def _shape(node: dict[str, Any]) -> Any:
    return (node["session"], [_shape(c) for c in node["children"]])


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


async def test_the_live_view_on_the_store_counts_the_fleets_trees(upstream, replicas, http):
    a, b = await replicas(2, upstream=upstream.url, mode="dynamo_headers")
    for i in range(4):
        assert (await post(http, a, f"r{i}"))[0] == 200
        assert (await post(http, b, f"c{i}", parent=f"r{i}"))[0] == 200
    for sc in (a, b):
        # (the replicas write behind, and a snapshot is reused for a second: wait for both)
        _, data = await eventually(
            lambda sc=sc: api(http, "GET", sc.admin_url + "/ui/data.json"),
            lambda got: got[0] == 200 and got[1]["live_sessions"] == 8 and got[1]["shown_trees"] == 4,
        )
        assert (data["live_trees"], data["live_trees_exact"], data["truncated"]) == (4, True, False)
        assert data["limit"] == 200
        assert sorted((t["root"], [c["session"] for c in t["tree"]["children"]]) for t in data["trees"]) == [
            (f"r{i}", [f"c{i}"]) for i in range(4)
        ]
        _, two = await api(http, "GET", sc.admin_url + "/ui/data.json?limit=2")
        assert (two["live_trees"], two["shown_trees"], two["truncated"]) == (4, 2, True)


async def test_the_live_view_of_more_live_sessions_than_it_reads_counts_at_least_their_trees(
    upstream, replicas, http, redis_server
):
    (a,) = await replicas(1, upstream=upstream.url, mode="dynamo_headers", state={"timeout_ms": 5000})
    fill(a.router, 50, LIVE_READ)  # one tree of LIVE_READ + 51 live sessions
    total = LIVE_READ + 51
    await wait_for(lambda: redis_server.cli("ZCARD", replicas.prefix + "live").strip() == str(total), timeout=30)
    status, data = await api(http, "GET", a.admin_url + "/ui/data.json")
    assert status == 200 and data["live_sessions"] == total
    # the roots of LIVE_READ of them were read: one tree at least, and maybe more not shown
    assert (data["live_trees"], data["live_trees_exact"], data["truncated"]) == (1, False, True)
    assert [t["root"] for t in data["trees"]] == ["big"]


@pytest.mark.deploy
@pytest.mark.parametrize("engine", ["aiohttp"])
async def test_browser_draws_the_fleets_trees_and_their_count_from_the_store(upstream, replicas, http, tmp_path):
    binary = _chromium()
    a, b = await replicas(2, upstream=upstream.url, mode="dynamo_headers")
    for i in range(4):
        assert (await post(http, a, f"r{i}"))[0] == 200
        assert (await post(http, b, f"c{i}", parent=f"r{i}"))[0] == 200
    await eventually(
        lambda: api(http, "GET", b.admin_url + "/ui/data.json"),
        lambda got: got[0] == 200 and got[1]["live_sessions"] == 8 and got[1]["shown_trees"] == 4,
    )
    dom_html = (await _run_chromium(binary, tmp_path / "profile", "--dump-dom", b.admin_url + "/ui")).decode()
    dom = _Dom()
    dom.feed(dom_html)
    assert dom.parent_of == {**{f"r{i}": None for i in range(4)}, **{f"c{i}": f"r{i}" for i in range(4)}}
    assert re.search(r'<b id="n-trees">4</b>', dom_html), dom_html
    assert "null" not in " ".join(dom.text) and "most recently active" not in " ".join(dom.text)


LINEAGE = (("tp", None), ("tc", "tp"), ("tcc", "tc"))  # API sessions: a root, a child, a grandchild


async def test_an_api_session_created_with_a_parent_has_its_parents_root_from_creation(fleet, upstream, http):
    keyed = {
        "name": "default",
        "upstreams": [upstream.url],
        "mode": "smg_routing_key",
        "mode_options": {"scope": "tree"},
    }
    scs = await fleet(upstream=None, deployments=[keyed])
    for sid, parent in LINEAGE:
        assert (await create(http, scs[0], sid, parent))["root"] == "tp"

    async def roots() -> None:
        for sc in scs:
            for sid, parent in LINEAGE:
                status, seen = await api(http, "GET", f"{sc.admin_url}/v1/sessions/{sid}")
                assert status == 200 and (seen["parent"], seen["root"]) == (parent, "tp"), seen

    await roots()
    # the grandchild's first request (its parent and root had none): keyed by its tree's root on
    # every replica, and its root stays
    for sc in scs:
        assert (await post(http, sc, "tcc"))[0] == 200
        assert upstream.received[-1].header("X-SMG-Routing-Key") == "tp"
    await roots()


async def test_an_api_session_created_with_a_parent_is_in_its_parents_tree_on_the_store(upstream, replicas, http):
    a, b = await replicas(2, upstream=upstream.url, mode="dynamo_headers")
    for sid, parent in LINEAGE:
        await create(http, a, sid, parent)
    for sc in (a, b):
        for sid, _ in LINEAGE:
            status, tree = await api(http, "GET", f"{sc.admin_url}/v1/trees/{sid}")
            assert status == 200 and _shape(tree) == ("tp", [("tc", [("tcc", [])])]), tree
        _, data = await eventually(
            lambda sc=sc: api(http, "GET", sc.admin_url + "/ui/data.json"),
            lambda got: got[0] == 200 and got[1]["live_sessions"] == 3,
        )
        assert [(t["root"], _shape(t["tree"])) for t in data["trees"]] == [("tp", ("tp", [("tc", [("tcc", [])])]))]
        assert (data["live_trees"], data["truncated"]) == (1, False)


def _sorted_shape(node: dict[str, Any]) -> Any:
    """The shape of a tree, siblings in id order; checks they are shown oldest first."""
    created = [c["created_at"] for c in node["children"]]
    assert created == sorted(created), node
    return (node["session"], sorted(_sorted_shape(c) for c in node["children"]))


async def test_api_sessions_and_traffic_sessions_have_one_schema_in_every_view(fleet, upstream, http):
    # ap: an API session without a request, whose API child ac has one; ac2: its API child
    # without one; lone: an API session alone; t -> tk: sessions learned from traffic
    scs = await fleet(upstream=upstream.url, mode="dynamo_headers")
    for sid, parent in (("ap", None), ("ac", "ap"), ("ac2", "ap"), ("lone", None)):
        await create(http, scs[0], sid, parent)
    assert (await post(http, scs[-1], "ac"))[0] == 200
    assert (await post(http, scs[-1], "t"))[0] == 200
    assert (await post(http, scs[0], "tk", parent="t"))[0] == 200
    shapes = {
        "ap": ("ap", [("ac", []), ("ac2", [])]),
        "lone": ("lone", []),
        "t": ("t", [("tk", [])]),
    }
    for sc in scs:
        client = Api(http, sc.admin_url, await fetch_spec(http, sc.admin_url))  # validates every answer
        schemas = client.spec.doc["components"]["schemas"]
        fields = set(schemas["Session"]["properties"])
        node_fields = set(schemas["TreeNode"]["required"])  # (omitted, truncated: only when cut)
        for sid in ("ap", "ac", "ac2", "lone", "t", "tk"):
            status, seen = await client.get(sid)
            assert status == 200 and set(seen) == fields, seen
            assert seen["placeholder"] is False and seen["end_reason"] is None and seen["status"] == "active"
        status, page = await client.list()
        assert status == 200 and all(set(s) == fields for s in page["data"]) and len(page["data"]) == 4
        for sid, root in (("ap", "ap"), ("ac", "ap"), ("ac2", "ap"), ("lone", "lone"), ("tk", "t")):
            status, tree = await client.tree(sid)
            assert status == 200 and _sorted_shape(tree) == shapes[root], tree
            for node in walk(tree):
                assert set(node) == node_fields and node["placeholder"] is False and node["closed"] is False, node
                assert node["deployment"] == "default" and node["created_at"] is not None, node
        # the live view: every live session once, in its root's tree, none a placeholder
        _, data = await eventually(
            lambda sc=sc: api(http, "GET", sc.admin_url + "/ui/data.json"),
            lambda got: got[0] == 200 and got[1]["live_sessions"] == 6 and got[1]["shown_trees"] == 3,
        )
        assert (data["live_trees"], data["live_trees_exact"], data["truncated"]) == (3, True, False)
        assert {t["root"]: _sorted_shape(t["tree"]) for t in data["trees"]} == shapes
        for t in data["trees"]:
            assert t["live"] == t["sessions"] == len(walk(t["tree"])) and t["final"] is False
            for node in walk(t["tree"]):
                assert set(node) == node_fields and node["placeholder"] is False, node
                assert isinstance(node["created_at"], float) and isinstance(node["last_active_at"], float)
    # closed without a request: ended at once (the store's end after its settle window), the
    # API's reason
    client = Api(http, scs[0].admin_url, await fetch_spec(http, scs[0].admin_url))
    assert (await client.close("lone"))[0] == 200
    for sc in scs:
        _, seen = await eventually(
            lambda sc=sc: api(http, "GET", f"{sc.admin_url}/v1/sessions/lone"),
            lambda got: got[1]["end_reason"] is not None,
        )
        assert (seen["status"], seen["end_reason"], seen["placeholder"]) == ("closed", "api_closed", False)


async def api_workload(http: aiohttp.ClientSession, scs: list[Any]) -> None:
    """ap: an API session without a request, whose API child ac had one; lone: an API session
    alone, without a request."""
    for sid, parent in (("ap", None), ("ac", "ap"), ("lone", None)):
        await create(http, scs[0], sid, parent)
    assert (await post(http, scs[-1], "ac"))[0] == 200


async def test_the_live_view_shows_api_sessions_as_the_sessions_they_are_with_or_without_requests(
    fleet, upstream, http
):
    scs = await fleet(upstream=upstream.url, mode="dynamo_headers")
    await api_workload(http, scs)
    for sc in scs:
        _, data = await eventually(
            lambda sc=sc: api(http, "GET", sc.admin_url + "/ui/data.json"),
            lambda got: got[0] == 200 and got[1]["live_sessions"] == 3,
        )
        assert sorted((t["root"], _shape(t["tree"])) for t in data["trees"]) == [
            ("ap", ("ap", [("ac", [])])),
            ("lone", ("lone", [])),
        ]
        assert (data["live_trees"], data["truncated"]) == (2, False)
        nodes = {n["session"]: n for t in data["trees"] for n in walk(t["tree"])}
        assert [(sid, nodes[sid]["placeholder"], nodes[sid]["closed"]) for sid in ("ap", "ac", "lone")] == [
            ("ap", False, False),
            ("ac", False, False),
            ("lone", False, False),
        ]
        assert nodes["ac"]["turns"] == 1 and nodes["ap"]["turns"] == nodes["lone"]["turns"] == 0


@pytest.mark.deploy
@pytest.mark.parametrize("engine", ["aiohttp"])
async def test_browser_draws_api_sessions_as_the_sessions_they_are(fleet, upstream, http, tmp_path):
    binary = _chromium()
    scs = await fleet(upstream=upstream.url, mode="dynamo_headers")
    await api_workload(http, scs)
    await eventually(
        lambda: api(http, "GET", scs[-1].admin_url + "/ui/data.json"),
        lambda got: got[0] == 200 and got[1]["live_sessions"] == 3,
    )
    dom_html = (await _run_chromium(binary, tmp_path / "profile", "--dump-dom", scs[-1].admin_url + "/ui")).decode()
    dom = _Dom()
    dom.feed(dom_html)
    assert dom.parent_of == {"ap": None, "ac": "ap", "lone": None}
    assert all("active" in dom.classes[sid] and "placeholder" not in dom.classes[sid] for sid in dom.parent_of), (
        dom.classes
    )
    assert re.search(r'<b id="n-trees">2</b>', dom_html) and re.search(r'<b id="n-sessions">3</b>', dom_html)
