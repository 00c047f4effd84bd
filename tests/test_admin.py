"""Admin listener: health, readiness, metrics, session views, and every answer against the served
OpenAPI document (real sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from sidecar.admin.views import MAX_DEPTH
from tests.modes.wire import settled
from tests.proxy.test_errors import free_port
from tests.sessions.support import (
    TOKEN_A,
    TOKEN_ADMIN,
    Api,
    FakeClock,
    Launch,
    OpenAPI,
    deployment,
    fetch_spec,
    launcher,
    tokens_file,
)
from tests.state.conftest import redis_server  # noqa: F401  (the fixture, for the shared-store test)
from tests.waiting import eventually


@pytest.fixture
async def launch(engine: str) -> AsyncIterator[Launch]:
    async for f in launcher(engine):
        yield f


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_readyz_waits_for_upstream_then_ready(upstream, start_sidecar):
    sc = await start_sidecar(upstream=f"http://127.0.0.1:{free_port()}", mode="dynamo_headers")
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.admin_url}/healthz") as resp:
            assert resp.status == 200
        async with s.get(f"{sc.admin_url}/readyz") as resp:
            assert resp.status == 503
            assert (await resp.json())["status"] == "waiting_for_upstream"
    sc2 = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc2.proxy_url}/x") as resp:
            assert resp.status == 200
        async with s.get(f"{sc2.admin_url}/readyz") as resp:
            assert resp.status == 200


async def test_readyz_without_upstream_check(start_sidecar):
    sc = await start_sidecar(upstream=f"http://127.0.0.1:{free_port()}", readiness_check_upstream=False)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.admin_url}/readyz") as resp:
            assert resp.status == 200


async def test_metrics_after_known_workload(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    async with aiohttp.ClientSession() as s:
        for i in range(4):
            async with s.get(f"{sc.proxy_url}/ok", headers={"X-Correlation-ID": f"m{i % 2}"}) as resp:
                await resp.read()
        async with s.get(f"{sc.proxy_url}/status/404") as resp:
            await resp.read()
        async with s.get(f"{sc.admin_url}/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
    assert 'sidecar_requests_total{deployment="default",mode="dynamo_headers",status_class="2xx"} 4.0' in text
    assert 'sidecar_requests_total{deployment="default",mode="dynamo_headers",status_class="4xx"} 1.0' in text
    assert 'sidecar_request_duration_seconds_count{deployment="default",mode="dynamo_headers"} 5.0' in text
    assert 'sidecar_headers_injected_total{deployment="default",mode="dynamo_headers"} 4.0' in text
    assert "sidecar_live_sessions 2.0" in text
    # The proxy listener serves no admin paths: they belong to the upstream API.
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.proxy_url}/metrics") as resp:
            assert (await resp.json())["path"] == "/metrics"


async def test_session_and_tree_views(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.proxy_url}/a", headers={"X-Correlation-ID": "root-1"}) as resp:
            await resp.read()
        async with s.get(
            f"{sc.proxy_url}/b", headers={"X-Correlation-ID": "child-1", "X-Parent-Session-ID": "root-1"}
        ) as resp:
            await resp.read()
        async with s.get(f"{sc.admin_url}/v1/sessions/child-1") as resp:
            node = await resp.json()
        async with s.get(f"{sc.admin_url}/v1/trees/root-1") as resp:
            tree = await resp.json()
        async with s.get(f"{sc.admin_url}/v1/sessions/nope") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["type"] == "session_not_found"
    assert node["parent"] == "root-1" and node["root"] == "root-1" and node["turns"] == 1
    assert tree["session"] == "root-1"
    assert [c["session"] for c in tree["children"]] == ["child-1"]


# -- every answer of the admin listener against its own /openapi.json ---------------------------


class Recorded(Api):
    """An :class:`Api` client that also records each (method, path template, status) it saw."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        base: str,
        spec: OpenAPI,
        seen: set[tuple[str, str, int]],
        token: str | None = None,
    ) -> None:
        super().__init__(http, base, spec, token)
        self.seen = seen

    async def call(self, method: str, path: str, template: str, **kw: Any) -> tuple[int, Any]:
        status, body = await super().call(method, path, template, **kw)
        self.seen.add((method, template, status))
        return status, body


def documented(spec: OpenAPI) -> set[tuple[str, str, int]]:
    return {
        (method.upper(), path, int(status))
        for path, ops in spec.doc["paths"].items()
        for method, op in ops.items()
        for status in op["responses"]
    }


async def proxied(http: aiohttp.ClientSession, sc: Any, session: str, *, path: str = "/v1/x", **headers: str) -> None:
    async with http.post(sc.proxy_url + path, headers={"X-Correlation-ID": session, **headers}, json={}) as resp:
        assert resp.status == 200
        await resp.read()
    await settled(sc, session)


async def test_every_admin_answer_matches_the_openapi_document(launch, upstream, http):
    """Every operation and every status the document lists, on a real listener with tokens, each
    JSON answer validated against the served document (formats included: times are RFC 3339)."""
    clock = FakeClock()
    deployments = [deployment("chat", upstream.url), deployment("agents", upstream.url, strict=True)]
    sc = await launch(
        clock=clock,
        deployments=deployments,
        default_deployment="chat",
        admin_tokens_file=tokens_file(),
        sessions={"api": {"max_sessions": 3}},
    )
    down = await launch(deployments=[deployment("chat", f"http://127.0.0.1:{free_port()}")])
    spec = await fetch_spec(http, sc.admin_url)
    seen: set[tuple[str, str, int]] = set()
    anon, a, admin = (Recorded(http, sc.admin_url, spec, seen, token) for token in (None, TOKEN_A, TOKEN_ADMIN))
    assert (await Recorded(http, down.admin_url, spec, seen).call("GET", "/readyz", "/readyz"))[1]["deployments"]

    # health, metrics and the document itself need no token
    for path in ("/healthz", "/openapi.json"):
        assert (await anon.call("GET", path, path))[0] == 200
    async with http.get(sc.admin_url + "/metrics") as resp:
        assert resp.status == 200 and resp.content_type == "text/plain"
        seen.add(("GET", "/metrics", 200))
    for method, path, template in (
        ("POST", "/v1/sessions", "/v1/sessions"),
        ("GET", "/v1/sessions", "/v1/sessions"),
        ("GET", "/v1/sessions/x", "/v1/sessions/{session_id}"),
        ("POST", "/v1/sessions/x/close", "/v1/sessions/{session_id}/close"),
        ("GET", "/v1/trees/x", "/v1/trees/{root}"),
    ):
        assert (await anon.call(method, path, template, json={} if method == "POST" else None))[0] == 401

    # traffic: worker history, an ended session held by its child, a placeholder, a root hint,
    # a chain deeper than the views nest
    for w in ("w1", "w1", "w2"):
        await proxied(http, sc, "t-root", path=f"/worker?w={w}")
    await proxied(http, sc, "t-mid", **{"X-Parent-Session-ID": "t-root"})
    await proxied(http, sc, "t-leaf", **{"X-Parent-Session-ID": "t-mid"})
    await proxied(http, sc, "t-mid", **{"X-Parent-Session-ID": "t-root", "X-Session-Final": "true"})
    await proxied(http, sc, "t-hinted", **{"X-Root-Session-ID": "t-root"})
    await proxied(http, sc, "t-orphan", **{"X-Parent-Session-ID": "t-ghost"})
    for i in range(MAX_DEPTH + 2):
        await proxied(http, sc, f"c{i}", **({"X-Parent-Session-ID": f"c{i - 1}"} if i else {}))
    for _ in range(500):  # ready once its upstreams were seen (a probe or the traffic)
        if (await admin.call("GET", "/readyz", "/readyz"))[0] == 200:
            break
        await asyncio.sleep(0.01)
    assert ("GET", "/readyz", 200) in seen

    status, root = await admin.get("t-root")
    assert status == 200 and root["origin"] == "traffic" and root["workspace"] is None
    assert root["workers"] == [{"worker": "w1", "turns": 2}, {"worker": "w2", "turns": 1}]
    status, mid = await admin.get("t-mid")
    assert status == 200 and mid["end_reason"] == "final_turn_completed" and mid["status"] == "closed"
    status, ghost = await admin.get("t-ghost")
    assert status == 200 and ghost["placeholder"] is True
    status, tree = await admin.tree("t-leaf")
    assert status == 200 and [c["session"] for c in tree["children"]] == ["t-mid", "t-hinted"]
    assert tree["children"][1]["parent"] is None and tree["children"][0]["end_reason"] == "final_turn_completed"
    status, chain = await admin.tree("c0")
    node = chain
    while node["children"]:
        node = node["children"][0]
    assert status == 200 and node["omitted"] == 1
    assert (await admin.tree("t-ghost"))[1]["placeholder"] is True
    assert (await admin.close("t-root"))[1]["status"] == "closed"
    assert (await admin.close("t-ghost"))[0] == 404  # a placeholder has nothing to close

    # API sessions: a workspace's, an admin's (no workspace), a child, one with traffic, one expired
    status, first = await a.create(deployment="agents", session_id="ws-a:one", ttl_seconds=30)
    assert status == 201 and first["workspace"] == "ws-a" and first["last_active_at"] is None
    assert (await a.create(deployment="agents", session_id="ws-a:two", parent="ws-a:one"))[0] == 201
    status, adm = await admin.create(deployment="chat", ttl_seconds=5)
    assert status == 201 and adm["workspace"] is None
    assert (await a.create(deployment="agents"))[1]["error"]["type"] == "session_limit_reached"
    clock.advance(6)
    sc.router.expire()
    status, expired = await admin.get(adm["id"])
    assert expired["status"] == "expired" and expired["ended_at"] is not None
    await proxied(http, sc, "ws-a:one", path="/worker?w=w7")
    status, used = await a.get("ws-a:one")
    assert used["turns"] == 1 and used["workers"] == [{"worker": "w7", "turns": 1}]
    assert (await a.create(deployment="agents", session_id="ws-a:one"))[0] == 409
    assert (await a.create(deployment="nope"))[0] == 400
    assert (await a.create(deployment="agents", parent="ws-a:missing"))[0] == 404
    assert (await a.get("t-leaf"))[0] == 404  # traffic sessions: admins only
    status, page = await a.list(limit="1")
    assert status == 200 and len(page["data"]) == 1 and page["next_cursor"] is not None
    status, rest = await a.list(cursor=page["next_cursor"])
    assert [s["id"] for s in page["data"] + rest["data"]] == ["ws-a:one", "ws-a:two"] and rest["next_cursor"] is None
    assert (await a.list(limit="0"))[0] == 400
    status, tree = await a.tree("ws-a:one")
    assert status == 200 and tree["workers"] == [{"worker": "w7", "turns": 1}]
    assert (await a.tree("t-root"))[0] == 404
    assert (await a.close("ws-a:one"))[1]["status"] == "closed"
    assert (await a.close("ws-a:one"))[1]["status"] == "closed"  # idempotent
    assert (await a.close("ws-a:nope"))[0] == 404

    assert seen == documented(spec), sorted(documented(spec) - seen)


async def test_shared_store_answers_match_the_openapi_document(redis_server, launch, upstream, http):  # noqa: F811 (the fixture imported above)
    """The shared store builds its answers apart from the memory store's: the same document holds."""
    keys = {
        "deployments": [deployment("chat", upstream.url)],
        "readiness_check_upstream": False,
        "state": {"url": redis_server.url},
    }
    one, two = await launch(**keys), await launch(**keys)
    spec = await fetch_spec(http, one.admin_url)
    seen: set[tuple[str, str, int]] = set()
    api_one, api_two = (Recorded(http, sc.admin_url, spec, seen) for sc in (one, two))
    assert (await api_one.create(deployment="chat", session_id="api-1", ttl_seconds=60))[0] == 201
    await proxied(http, one, "api-1", path="/worker?w=w1")
    await proxied(http, two, "kid", **{"X-Parent-Session-ID": "api-1"})
    await proxied(http, two, "orphan", **{"X-Parent-Session-ID": "ghost"})
    await proxied(http, two, "kid", **{"X-Parent-Session-ID": "api-1", "X-Session-Final": "true"})

    # Each replica writes behind, and the kid's end is claimed in the store once its settle window
    # passed (~0.7 s by default) and a flush ran: about 0.6 s here, bounded generously for a loaded
    # machine (where a store call that times out also opens a replica's breaker for a second).
    status, tree = await eventually(
        lambda: api_two.tree("api-1"),
        lambda got: got[0] == 200 and [c["ended"] for c in got[1]["children"]] == [True],
        timeout=15,
        interval=0.02,
    )
    status, ghost = await api_one.tree("orphan")
    assert status == 200 and ghost["placeholder"] is True and [c["session"] for c in ghost["children"]] == ["orphan"]
    for api in (api_one, api_two):
        status, api_1 = await api.get("api-1")
        assert status == 200 and api_1["origin"] == "api" and api_1["turns"] == 1
        status, page = await api.list()
        assert status == 200 and [s["id"] for s in page["data"]] == ["api-1"]
        assert (await api.get("nope"))[0] == 404
    status, kid = await api_one.get("kid")
    assert status == 200 and kid["origin"] == "traffic" and kid["end_reason"] == "final_turn_completed"
    assert (await api_two.close("orphan"))[1]["status"] == "closed"
    assert (await api_two.close("api-1"))[1]["status"] == "closed"
    assert (await api_one.create(deployment="chat", session_id="api-1"))[0] == 409
    assert {
        ("GET", "/v1/trees/{root}", 200),
        ("GET", "/v1/sessions/{session_id}", 200),
        ("POST", "/v1/sessions/{session_id}/close", 200),
        ("GET", "/v1/sessions", 200),
    } <= seen


async def test_every_time_field_is_documented_as_rfc3339(launch, http):
    sc = await launch(deployments=[deployment("chat", "http://127.0.0.1:9")], readiness_check_upstream=False)
    spec = await fetch_spec(http, sc.admin_url)
    times = {}
    for name, schema in spec.doc["components"]["schemas"].items():
        for field, prop in schema.get("properties", {}).items():
            if field.endswith("_at") or field == "since":
                times[f"{name}.{field}"] = prop.get("format")
    assert {"Session.created_at", "Session.expires_at", "TreeNode.last_active_at", "UpstreamReadiness.since"} <= set(
        times
    )
    assert set(times.values()) == {"date-time"}, times
