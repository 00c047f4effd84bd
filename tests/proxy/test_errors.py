"""Failures answered as JSON errors with a stable type naming the deployment/upstream."""

from __future__ import annotations

import socket

import aiohttp


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all bound at once: picks one after the other may repeat)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


async def test_unreachable_upstream_is_502_json(start_sidecar):
    dead = f"http://127.0.0.1:{free_port()}"
    sc = await start_sidecar(upstream=dead, mode="dynamo_headers")
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.proxy_url}/v1/models", headers={"X-Correlation-ID": "s"}) as resp:
            assert resp.status == 502
            assert resp.content_type == "application/json"
            err = (await resp.json())["error"]
    assert err["type"] == "upstream_unreachable"
    assert err["deployment"] == "default"
    # The upstream is named by its index, never by URL (it may carry credentials or internal
    # addresses), with a reason.
    assert err["upstream"] == 0
    assert err["message"] == "upstream 0 of deployment 'default' is unreachable: connection refused"
    assert dead.split("//")[1] not in str(err)


async def test_slow_upstream_is_504_json(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers", timeouts={"first_byte": 0.3})
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.proxy_url}/slow?delay=2") as resp:
            assert resp.status == 504
            err = (await resp.json())["error"]
    assert err["type"] == "upstream_timeout"
    assert err["upstream"] == 0
    assert upstream.url.split("//")[1] not in str(err)


async def test_oversized_body_is_413_json(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers", limits={"max_body_bytes": 1000})
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{sc.proxy_url}/v1/chat/completions", data=b"x" * 1001) as resp:
            assert resp.status == 413
            err = (await resp.json())["error"]
        async with s.post(f"{sc.proxy_url}/v1/chat/completions", data=b"x" * 1000) as resp:
            assert resp.status == 200
    assert err["type"] == "request_too_large"
    assert err["limit"] == 1000
    # The oversized request never reached the upstream.
    assert [r.body for r in upstream.received] == [b"x" * 1000]


async def test_metrics_count_errors_by_kind(start_sidecar):
    sc = await start_sidecar(upstream=f"http://127.0.0.1:{free_port()}", mode="dynamo_headers")
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.get(f"{sc.proxy_url}/x") as resp:
                assert resp.status == 502
        async with s.get(f"{sc.admin_url}/metrics") as resp:
            text = await resp.text()
    assert 'sidecar_upstream_errors_total{deployment="default",kind="connect"} 3.0' in text
    assert 'sidecar_requests_total{deployment="default",mode="dynamo_headers",status_class="5xx"} 3.0' in text
