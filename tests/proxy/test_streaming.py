"""Streaming behaviour on the wire: SSE chunk-by-chunk, gzip untouched, large bodies, disconnects."""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import aiohttp

from tests.upstream import GZIP_PAYLOAD
from tests.waiting import LoopLag


async def test_sse_chunks_arrive_while_upstream_still_sending(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{sc.proxy_url}/sse?chunks=3&gap=0.3", json={"stream": True}, headers={"X-Correlation-ID": "sess-sse"}
        ) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "text/event-stream"
            first = await resp.content.readuntil(b"\n\n")
            got_first_at = time.monotonic()
            assert first == b'data: {"i":0}\n\n'
            # The upstream has sent exactly one event so far: the next is 300 ms away.
            assert len(upstream.sse_sent_at) == 1
            rest = await resp.read()
    assert rest == b'data: {"i":1}\n\ndata: {"i":2}\n\ndata: [DONE]\n\n'
    assert upstream.sse_sent_at[1] > got_first_at


async def test_gzip_body_passes_byte_identical(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        async with s.get(f"{sc.proxy_url}/gzip", headers={"Accept-Encoding": "gzip"}) as resp:
            assert resp.headers["Content-Encoding"] == "gzip"
            body = await resp.read()
    assert body == GZIP_PAYLOAD
    assert upstream.received[0].header("Accept-Encoding") == "gzip"


async def test_20mib_request_body_streams_with_bounded_memory(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    chunk = b"x" * 65536
    total = 20 * 1024 * 1024

    async def body():
        for _ in range(total // len(chunk)):
            yield chunk

    tracemalloc.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{sc.proxy_url}/big", data=body(), headers={"X-Correlation-ID": "big-1"}) as resp:
                assert resp.status == 200
                assert (await resp.json()) == {"bytes": total}
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert upstream.max_body_seen == total
    # Sidecar, upstream and client share this process: all of them together stay far below 20 MiB.
    assert peak < 8 * 1024 * 1024, peak


async def test_client_disconnect_mid_stream_closes_upstream(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    reader, writer = await asyncio.open_connection("127.0.0.1", int(sc.proxy_url.rsplit(":", 1)[1]))
    writer.write(b"GET /sse?chunks=50&gap=0.1 HTTP/1.1\r\nHost: x\r\nX-Correlation-ID: gone\r\n\r\n")
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    await reader.read(10)  # the first event is flowing
    async with LoopLag() as lag:
        writer.close()
        closed_at = time.monotonic()
        await asyncio.wait_for(upstream.disconnected.wait(), 10)
        gone_after = time.monotonic() - closed_at
    assert gone_after < 1.0 + lag.worst  # (what a busy machine delayed the loop by is not the sidecar's)
    assert len(upstream.sse_sent_at) < 50


async def test_chunked_upstream_response_relayed(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.proxy_url}/sse?chunks=5&gap=0") as resp:
            body = await resp.read()
    assert body.count(b"data: ") == 6
