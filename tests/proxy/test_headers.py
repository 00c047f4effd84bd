"""Header handling on the wire: affinity headers, hop-by-hop, forwarding headers, passthrough."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson


async def raw_request(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    out = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return out


async def test_correlation_id_becomes_dynamo_session_id(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{sc.proxy_url}/v1/chat/completions",
            data=b'{"a": 1}',
            headers={
                "X-Correlation-ID": "sess-1",
                "X-Request-ID": "req-1",
                "X-Parent-Session-ID": "parent-1",
                "X-Dynamo-Session-ID": "spoofed",
            },
        ) as resp:
            assert resp.status == 200
    rec = upstream.received[0]
    assert rec.all("X-Dynamo-Session-ID") == ["sess-1"]
    assert rec.all("X-Dynamo-Parent-Session-ID") == ["parent-1"]
    assert rec.header("X-Correlation-ID") == "sess-1"
    assert rec.header("X-Request-ID") == "req-1"
    assert rec.body == b'{"a": 1}'
    assert rec.path == "/v1/chat/completions"


async def test_root_session_has_no_parent_header(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    async with aiohttp.ClientSession() as s:
        for sid in ("a", "b"):
            async with s.get(f"{sc.proxy_url}/x?q=1&r=%20", headers={"X-Session-Affinity": sid}) as resp:
                await resp.read()
    assert [r.all("X-Dynamo-Session-ID") for r in upstream.received] == [["a"], ["b"]]
    assert all(r.header("X-Dynamo-Parent-Session-ID") is None for r in upstream.received)
    assert upstream.received[0].path == "/x?q=1&r=%20"


async def test_request_without_session_passes_untouched(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{sc.proxy_url}/v1/completions",
            data=b"  raw  ",
            headers={"X-Request-ID": "only-request-id", "X-Dynamo-Session-ID": "client-own", "X-Custom": "1"},
        ) as resp:
            assert resp.status == 200
    rec = upstream.received[0]
    # X-Request-ID is never a session key; with no session signal nothing is added or removed.
    assert rec.all("X-Dynamo-Session-ID") == ["client-own"]
    assert rec.header("X-Custom") == "1"
    assert rec.body == b"  raw  "


async def test_hop_by_hop_request_headers_dropped(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    req = (
        b"GET /h HTTP/1.1\r\nHost: client.example\r\nConnection: keep-alive, X-Hop-Private\r\n"
        b"X-Hop-Private: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nProxy-Authorization: Basic x\r\n"
        b"X-Forwarded-For: 10.9.8.7\r\nX-End: yes\r\n\r\n"
    )
    out = await raw_request(sc.proxy_url, req.replace(b"keep-alive, X-Hop", b"close, X-Hop"))
    assert out.startswith(b"HTTP/1.1 200")
    rec = upstream.received[0]
    names = {k.lower() for k, _ in rec.headers}
    for hop in ("x-hop-private", "keep-alive", "te", "proxy-authorization"):
        assert hop not in names
    assert rec.header("X-End") == "yes"
    assert rec.header("X-Forwarded-For") == "10.9.8.7, 127.0.0.1"
    assert rec.header("X-Forwarded-Proto") == "http"
    assert rec.header("Host") == upstream.url.removeprefix("http://")


async def test_hop_by_hop_response_headers_dropped(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.proxy_url}/hop") as resp:
            assert await resp.text() == "ok"
            assert resp.headers["X-End-To-End"] == "kept"
            assert "X-Private-Hop" not in resp.headers
            assert "Proxy-Authenticate" not in resp.headers
            assert "timeout=5" not in resp.headers.get("Keep-Alive", "")


async def test_upstream_status_and_body_relayed(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.proxy_url}/status/418") as resp:
            assert resp.status == 418
            assert orjson.loads(await resp.read()) == {"status": 418}


async def test_keepalive_reuses_upstream_connections(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    async with aiohttp.ClientSession() as s:
        for i in range(20):
            async with s.get(f"{sc.proxy_url}/k{i}", headers={"X-Correlation-ID": "k"}) as resp:
                assert resp.status == 200
    assert len(upstream.received) == 20
    assert len(upstream.peers) <= 2, upstream.peers
