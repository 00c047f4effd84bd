"""Strict deployments on the wire: only API-created sessions pass, validated ids only."""

from __future__ import annotations

import aiohttp

from tests.sessions.support import Api, FakeClock, deployment, fetch_spec, metrics_text
from tests.upstream import RecordingUpstream


async def strict_sidecar(launch, http, url: str, clock: FakeClock | None = None, **dep_keys):
    keys = {"mode": "dynamo_headers", **dep_keys}
    sc = await launch(deployments=[deployment("agents", url, strict=True, **keys)], clock=clock)
    return sc, Api(http, sc.admin_url, await fetch_spec(http, sc.admin_url))


async def send(http: aiohttp.ClientSession, sc, headers: dict[str, str], path: str = "/v1/chat") -> tuple[int, dict]:
    async with http.post(sc.proxy_url + path, data=b'{"model": "m"}', headers=headers) as resp:
        return resp.status, await resp.json()


async def test_strict_rejections_and_acceptance(launch, http, upstream: RecordingUpstream):
    clock = FakeClock()
    sc, api = await strict_sidecar(launch, http, upstream.url, clock)
    status, err = await send(http, sc, {})
    assert status == 400 and err["error"]["type"] == "session_required"
    status, err = await send(http, sc, {"X-Correlation-ID": "never-created"})
    assert status == 404 and err["error"]["type"] == "session_not_found"
    await api.create(deployment="agents", session_id="ok-1", ttl_seconds=30)
    status, _ = await send(http, sc, {"X-Correlation-ID": "ok-1"})
    assert status == 200
    await api.close("ok-1")
    status, err = await send(http, sc, {"X-Correlation-ID": "ok-1"})
    assert status == 410 and err["error"]["type"] == "session_closed"
    await api.create(deployment="agents", session_id="ok-2", ttl_seconds=30)
    clock.advance(31)
    sc.router.expire()
    status, err = await send(http, sc, {"X-Session-ID": "ok-2"})
    assert status == 410 and err["error"]["type"] == "session_expired"
    assert len(upstream.received) == 1  # only the accepted request reached the upstream
    text = await metrics_text(http, sc.admin_url)
    for reason in ("session_required", "session_not_found", "session_closed", "session_expired"):
        assert f'sidecar_rejected_requests_total{{reason="{reason}"}} 1.0' in text


async def test_spoofed_session_headers_never_reach_upstream(launch, http, upstream: RecordingUpstream):
    sc, api = await strict_sidecar(launch, http, upstream.url)
    await api.create(deployment="agents", session_id="valid-1")
    status, _ = await send(
        http,
        sc,
        {
            "X-Correlation-ID": "valid-1",
            "X-Session-ID": "spoofed",
            "X-Dynamo-Session-ID": "spoofed",
            "X-Session-Affinity": "spoofed",
            "X-Parent-Session-ID": "spoofed-parent",
            "X-Root-Session-ID": "spoofed-root",
        },
    )
    assert status == 200
    [rec] = upstream.received
    assert rec.all("X-Dynamo-Session-ID") == ["valid-1"]
    assert rec.header("X-Dynamo-Parent-Session-ID") is None
    for name in ("X-Correlation-ID", "X-Session-ID", "X-Session-Affinity", "X-Parent-Session-ID", "X-Root-Session-ID"):
        assert rec.header(name) is None, name
    assert not any("spoofed" in v for _, v in rec.headers)


async def test_strict_without_mode_readds_validated_id(launch, http, upstream: RecordingUpstream):
    sc = await launch(deployments=[deployment("agents", upstream.url, strict=True)])
    api = Api(http, sc.admin_url, await fetch_spec(http, sc.admin_url))
    await api.create(deployment="agents", session_id="plain-1")
    status, _ = await send(http, sc, {"X-Session-Affinity": "plain-1", "X-Session-ID": "spoofed"})
    assert status == 200
    [rec] = upstream.received
    assert rec.all("X-Correlation-ID") == ["plain-1"]
    assert rec.header("X-Session-ID") is None and rec.header("X-Session-Affinity") is None


async def test_api_parent_defines_lineage_in_strict_mode(launch, http, upstream: RecordingUpstream):
    sc, api = await strict_sidecar(launch, http, upstream.url)
    await api.create(deployment="agents", session_id="p-1")
    await api.create(deployment="agents", session_id="c-1", parent="p-1")
    assert (await send(http, sc, {"X-Correlation-ID": "c-1", "X-Parent-Session-ID": "claimed"}))[0] == 200
    rec = upstream.received[-1]
    assert rec.all("X-Dynamo-Parent-Session-ID") == ["p-1"]
    assert sc.router.tree.get("c-1")["root"] == "p-1"


async def test_closed_api_session_is_410_on_non_strict_deployment(launch, http, upstream: RecordingUpstream):
    sc = await launch(deployments=[deployment("chat", upstream.url, mode="dynamo_headers")])
    api = Api(http, sc.admin_url, await fetch_spec(http, sc.admin_url))
    await api.create(deployment="chat", session_id="open-1")
    assert (await send(http, sc, {"X-Correlation-ID": "open-1"}))[0] == 200
    await api.close("open-1")
    status, err = await send(http, sc, {"X-Correlation-ID": "open-1"})
    assert status == 410 and err["error"]["type"] == "session_closed"
    assert (await send(http, sc, {"X-Correlation-ID": "header-only"}))[0] == 200  # not strict
