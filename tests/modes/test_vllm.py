"""vllm_router mode on the wire: x-session-id, and one /finish_session per ended session."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from tests.waiting import wait_for


def finishes(upstream) -> list[str]:
    return [r.path for r in upstream.received if r.path.startswith("/finish_session")]


async def test_session_header_and_finish_session_once_per_session(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="vllm_router")
    async with aiohttp.ClientSession() as s:
        for turn in (1, 2, 3):
            for sid in ("sess-a", "sess-b"):
                headers = {"X-Correlation-ID": sid, "x-session-id": "spoof"}
                if turn == 3:
                    headers["X-Session-Final"] = "true"
                async with s.post(f"{sc.proxy_url}/v1/chat/completions", data=b"{}", headers=headers) as resp:
                    assert resp.status == 200
    await wait_for(lambda: len(finishes(upstream)) == 2)
    await asyncio.sleep(0.2)  # a repeated finish_session would show up here
    assert sorted(finishes(upstream)) == ["/finish_session?session_id=sess-a", "/finish_session?session_id=sess-b"]
    chats = [r for r in upstream.received if r.path == "/v1/chat/completions"]
    assert [r.all("x-session-id") for r in chats] == [["sess-a"], ["sess-b"]] * 3
    # (counted when the gateway's answer reached the sidecar: a moment after the gateway had the call)
    await wait_for(lambda: ended_ok(sc) == 2)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.admin_url}/metrics") as resp:
            text = await resp.text()
    assert 'sidecar_end_actions_total{mode="vllm_router",outcome="ok"} 2.0' in text


async def test_finish_session_retried_on_failure_without_blocking_traffic(upstream, start_sidecar):
    upstream.finish_failures = 2
    sc = await start_sidecar(upstream=upstream.url, mode="vllm_router")
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.proxy_url}/x", headers={"X-Correlation-ID": "r1", "X-Session-Final": "true"}) as resp:
            assert resp.status == 200
        # Client traffic is not held up by the pending end-of-session call.
        async with s.get(f"{sc.proxy_url}/y", headers={"X-Correlation-ID": "r2"}) as resp:
            assert resp.status == 200
    await wait_for(lambda: len(finishes(upstream)) == 3)
    assert finishes(upstream) == ["/finish_session?session_id=r1"] * 3
    # (counted when the third answer reached the sidecar: a moment after the gateway had the call)
    await wait_for(lambda: ended_ok(sc) == 1)
    assert (
        sc.metrics.registry.get_sample_value("sidecar_end_actions_total", {"mode": "vllm_router", "outcome": "failed"})
        is None
    )


def ended_ok(sc: Any) -> float | None:
    """The sidecar's count of end actions the gateway acknowledged."""
    return sc.metrics.registry.get_sample_value("sidecar_end_actions_total", {"mode": "vllm_router", "outcome": "ok"})


async def test_a_session_id_that_is_not_utf8_is_finished_under_its_own_bytes(upstream, start_sidecar):
    # The client's id bytes reach the gateway as they were sent (x-session-id), and the end
    # action names exactly those bytes, percent-encoded: never a different session ("raw").
    sc = await start_sidecar(upstream=upstream.url, mode="vllm_router")
    host, port = sc.proxy_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Correlation-ID: \xff\xfe\x80raw\r\n"
        b"X-Session-Final: true\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    )
    await writer.drain()
    assert (await reader.read()).startswith(b"HTTP/1.1 200")
    writer.close()
    await wait_for(lambda: finishes(upstream))
    assert finishes(upstream) == ["/finish_session?session_id=%FF%FE%80raw"]
    (chat,) = [r for r in upstream.received if r.path == "/v1/chat/completions"]
    assert [v.encode("latin-1") for v in chat.all("x-session-id")] == [b"\xff\xfe\x80raw"]
