"""The sessions API on a real admin listener, every answer validated against /openapi.json."""

from __future__ import annotations

import asyncio
import uuid

from tests.sessions.support import Api, FakeClock, deployment, fetch_spec
from tests.upstream import RecordingUpstream

UP = "http://127.0.0.1:9"  # never contacted by these tests


def two_deployments(url: str = UP) -> list[dict]:
    return [deployment("chat", url, mode="dynamo_headers"), deployment("agents", url, strict=True)]


async def api_for(http, sc) -> Api:
    return Api(http, sc.admin_url, await fetch_spec(http, sc.admin_url))


async def test_openapi_document_is_public_and_31(launch_api, http):
    sc = await launch_api(deployments=two_deployments(), readiness_check_upstream=False)
    spec = await fetch_spec(http, sc.admin_url)
    assert set(spec.doc["paths"]) >= {
        "/v1/sessions",
        "/v1/sessions/{session_id}",
        "/v1/sessions/{session_id}/close",
        "/v1/trees/{root}",
        "/healthz",
    }
    session = spec.doc["components"]["schemas"]["Session"]["properties"]
    assert session["expires_at"]["type"] == ["string", "null"]
    assert session["last_active_at"]["type"] == ["string", "null"]
    params = {p["name"] for p in spec.doc["paths"]["/v1/sessions"]["get"]["parameters"]}
    assert params == {"deployment", "status", "limit", "cursor"}


async def test_create_get_close_lifecycle(launch_api, http):
    clock = FakeClock()
    sc = await launch_api(deployments=two_deployments(), readiness_check_upstream=False, clock=clock)
    api = await api_for(http, sc)
    status, s = await api.create(deployment="agents", ttl_seconds=60)
    assert status == 201
    uuid.UUID(s["id"])  # generated
    assert s["status"] == "active" and s["deployment"] == "agents" and s["origin"] == "api"
    assert s["last_active_at"] is None and s["ended_at"] is None
    assert s["created_at"].endswith("Z") and s["expires_at"] is not None
    status, same = await api.get(s["id"])
    assert status == 200 and same == s
    clock.advance(5)
    status, closed = await api.close(s["id"])
    assert status == 200 and closed["status"] == "closed" and closed["ended_at"] is not None
    assert closed["expires_at"] is None
    clock.advance(5)
    status, again = await api.close(s["id"])  # idempotent: unchanged
    assert status == 200 and again == closed


async def test_create_with_id_parent_and_default_ttl(launch_api, http):
    sc = await launch_api(
        deployments=two_deployments(), readiness_check_upstream=False, sessions={"api": {"default_ttl_seconds": None}}
    )
    api = await api_for(http, sc)
    status, root = await api.create(deployment="agents", session_id="root-1")
    assert status == 201 and root["id"] == "root-1" and root["expires_at"] is None and root["ttl_seconds"] is None
    status, child = await api.create(deployment="agents", session_id="child-1", parent="root-1")
    assert status == 201 and child["parent"] == "root-1"


async def test_create_errors(launch_api, http):
    sc = await launch_api(
        deployments=two_deployments(),
        readiness_check_upstream=False,
        sessions={"api": {"max_sessions": 2, "max_ttl_seconds": 100, "default_ttl_seconds": 50}},
    )
    api = await api_for(http, sc)
    cases = [
        ({}, 400, "invalid_request"),
        ({"deployment": "agents", "bogus": 1}, 400, "invalid_request"),
        ({"deployment": "nope"}, 400, "unknown_deployment"),
        ({"deployment": "agents", "session_id": "has space"}, 400, "invalid_request"),
        ({"deployment": "agents", "ttl_seconds": 0}, 400, "invalid_request"),
        ({"deployment": "agents", "ttl_seconds": 101}, 400, "invalid_request"),
        ({"deployment": "agents", "ttl_seconds": "5"}, 400, "invalid_request"),
        ({"deployment": "agents", "parent": "missing"}, 404, "parent_not_found"),
    ]
    for body, status, type_ in cases:
        got, err = await api.create(**body)
        assert (got, err["error"]["type"]) == (status, type_), body
    got, err = await api.call("POST", "/v1/sessions", "/v1/sessions", data=b"[1, 2")
    assert got == 400 and err["error"]["type"] == "invalid_request"
    assert (await api.create(deployment="agents", session_id="dup"))[0] == 201
    got, err = await api.create(deployment="chat", session_id="dup")
    assert got == 409 and err["error"]["type"] == "session_exists"
    assert (await api.create(deployment="agents"))[0] == 201
    got, err = await api.create(deployment="agents")  # max_sessions: 2
    assert got == 429 and err["error"]["type"] == "session_limit_reached"
    assert (await api.close("dup"))[0] == 200
    got, err = await api.create(deployment="agents", session_id="dup")  # tombstoned id
    assert got == 409
    assert (await api.create(deployment="agents"))[0] == 201  # room again after the close


async def test_parent_must_be_same_deployment(launch_api, http):
    sc = await launch_api(deployments=two_deployments(), readiness_check_upstream=False)
    api = await api_for(http, sc)
    await api.create(deployment="chat", session_id="p-chat")
    got, err = await api.create(deployment="agents", parent="p-chat")
    assert got == 404 and err["error"]["type"] == "parent_not_found"


async def test_list_pagination_and_filters(launch_api, http):
    sc = await launch_api(deployments=two_deployments(), readiness_check_upstream=False)
    api = await api_for(http, sc)
    ids = []
    for i in range(7):
        _, s = await api.create(deployment="agents" if i % 2 else "chat", session_id=f"s{i}")
        ids.append(s["id"])
    await api.close("s3")
    seen, cursor, pages = [], None, 0
    while True:
        params = {"limit": "3", **({"cursor": cursor} if cursor else {})}
        status, page = await api.list(**params)
        assert status == 200
        pages += 1
        seen += [s["id"] for s in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
        # a session created meanwhile lands after the ones already listed (stable order)
        if pages == 1:
            await api.create(deployment="chat", session_id="late")
    assert seen == ids + ["late"] and pages == 3
    _, agents = await api.list(deployment="agents")
    assert [s["id"] for s in agents["data"]] == ["s1", "s3", "s5"]
    _, closed = await api.list(status="closed")
    assert [s["id"] for s in closed["data"]] == ["s3"]
    _, active_agents = await api.list(deployment="agents", status="active")
    assert [s["id"] for s in active_agents["data"]] == ["s1", "s5"]
    _, none = await api.list(deployment="no-such")
    assert none == {"data": [], "next_cursor": None}
    for params in ({"limit": "0"}, {"limit": "1001"}, {"limit": "x"}, {"status": "open"}, {"cursor": "garbage!"}):
        status, err = await api.list(**params)
        assert status == 400 and err["error"]["type"] == "invalid_request", params


async def test_get_unknown_and_close_unknown_are_404(launch_api, http):
    sc = await launch_api(deployments=two_deployments(), readiness_check_upstream=False)
    api = await api_for(http, sc)
    for call in (api.get("nope"), api.close("nope")):
        status, err = await call
        assert status == 404 and err["error"]["type"] == "session_not_found"
    status, err = await api.tree("nope")
    assert status == 404 and err["error"]["type"] == "tree_not_found"
    async with http.get(sc.admin_url + "/v1/other") as resp:
        assert resp.status == 404 and (await resp.json())["error"]["type"] == "not_found"
    async with http.delete(sc.admin_url + "/v1/sessions") as resp:
        assert resp.status == 405 and "POST" in resp.headers["Allow"]


async def test_expiry_sliding_ttl_and_bounded_tombstones(launch_api, http):
    clock = FakeClock()
    sc = await launch_api(
        deployments=two_deployments(),
        readiness_check_upstream=False,
        clock=clock,
        sessions={"api": {"tombstone_max": 2, "tombstone_ttl_seconds": 100}},
    )
    api = await api_for(http, sc)
    for sid in ("e1", "e2", "e3"):
        await api.create(deployment="agents", session_id=sid, ttl_seconds=10)
    clock.advance(9)
    sc.router.expire()
    assert [(await api.get(s))[1]["status"] for s in ("e1", "e2", "e3")] == ["active"] * 3
    clock.advance(2)
    sc.router.expire()
    statuses = [(await api.get(s))[0] for s in ("e1", "e2", "e3")]
    assert statuses == [404, 200, 200]  # three expired, two tombstones kept (oldest dropped)
    _, e3 = await api.get("e3")
    assert e3["status"] == "expired" and e3["expires_at"] == e3["ended_at"]
    clock.advance(101)
    sc.router.expire()
    assert [(await api.get(s))[0] for s in ("e2", "e3")] == [404, 404]  # aged out
    assert sc.router.store.tombstones == 0


async def test_session_view_merges_lineage(launch_api, http, upstream: RecordingUpstream):
    sc = await launch_api(deployments=two_deployments(upstream.url), readiness_check_upstream=False)
    api = await api_for(http, sc)
    await api.create(deployment="agents", session_id="lin-root")
    await api.create(deployment="agents", session_id="lin-child", parent="lin-root")
    for sid in ("lin-root", "lin-child", "lin-child"):
        async with http.get(sc.proxy_url + "/v1/x", headers={"X-Correlation-ID": sid}) as resp:
            assert resp.status == 200
    _, child = await api.get("lin-child")
    assert child["turns"] == 2 and child["root"] == "lin-root" and child["parent"] == "lin-root"
    assert child["last_active_at"] is not None and child["in_flight"] == 0
    status, tree = await api.tree("lin-root")
    assert status == 200 and [c["session"] for c in tree["children"]] == ["lin-child"]
    # traffic-learned sessions stay visible (no tokens configured: open, admin view)
    async with http.get(sc.proxy_url + "/v1/x", headers={"X-Correlation-ID": "free", "X-Sidecar-Deployment": "chat"}):
        pass
    status, free = await api.get("free")
    assert status == 200 and free["origin"] == "traffic" and free["deployment"] == "chat" and free["turns"] == 1
    status, closed = await api.close("free")
    assert status == 200 and closed["status"] == "closed"


async def test_many_concurrent_creates_and_closes(launch_api, http):
    sc = await launch_api(deployments=two_deployments(), readiness_check_upstream=False)
    api = await api_for(http, sc)
    created = await asyncio.gather(*(api.create(deployment="agents", session_id=f"c{i}") for i in range(100)))
    assert all(s == 201 for s, _ in created)
    closes = await asyncio.gather(*(api.close(f"c{i % 100}") for i in range(300)))
    assert all(s == 200 and b["status"] == "closed" for s, b in closes)
    assert sc.router.store.active == 0 and sc.router.store.tombstones == 100
    dup = await asyncio.gather(*(api.create(deployment="agents", session_id="same") for _ in range(20)))
    assert sorted(s for s, _ in dup) == [201] + [409] * 19
