"""Admin listener: health, readiness, metrics and session views (real sockets)."""

from __future__ import annotations

import aiohttp

from tests.proxy.test_errors import free_port


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
        async with s.get(f"{sc.proxy_url}/b", headers={"X-Correlation-ID": "child-1",
                                                        "X-Parent-Session-ID": "root-1"}) as resp:
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
