"""/readyz follows the upstreams' health now, not "was one reached once": a dead upstream turns
it 503 with or without traffic and a recovered one back to 200; the body says why, per
deployment and upstream (by index: /readyz needs no token, URLs stay out of it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar import health
from tests.engine import RawMessage
from tests.proxy.test_errors import free_port
from tests.upstream import RecordingUpstream

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def readyz(sc: Any) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.admin_url}/readyz") as resp:
            return resp.status, await resp.json()


async def until(sc: Any, condition: Callable[[int, dict[str, Any]], bool], timeout: float = 10.0) -> dict[str, Any]:
    """Poll /readyz until ``condition(status, body)``; the body then."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = await readyz(sc)
        if condition(status, body):
            return body
        assert time.monotonic() < deadline, f"/readyz stayed {status}: {body}"
        await asyncio.sleep(0.02)


async def until_readyz(sc: Any, status: int) -> dict[str, Any]:
    return await until(sc, lambda got, _: got == status)


async def serve_on(port: int, up: RecordingUpstream) -> web.AppRunner:
    """The recording upstream on a given port (to bring an upstream back where it was)."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", up.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
    up.url = f"http://127.0.0.1:{port}"
    return runner


def only_upstream(body: dict[str, Any]) -> dict[str, Any]:
    (dep,) = body["deployments"]
    (up,) = dep["upstreams"]
    return up


async def test_dead_upstream_turns_readiness_off_and_back_without_traffic(start_sidecar, monkeypatch):
    monkeypatch.setattr(health, "PROBE_INTERVAL_SECONDS", 0.1)
    port = free_port()
    up = RecordingUpstream()
    runner = await serve_on(port, up)
    sc = await start_sidecar(upstream=f"http://127.0.0.1:{port}", mode="dynamo_headers")
    try:
        body = await until_readyz(sc, 200)
        assert body["status"] == "ready" and body["deployments"][0]["ready"] is True
        assert only_upstream(body) | {"since": None} == {
            "index": 0,
            "healthy": True,
            "checked_by": "connect",
            "reason": "connect succeeded",
            "since": None,
        }
        await runner.cleanup()
        body = await until_readyz(sc, 503)
        assert body["status"] == "waiting_for_upstream"
        assert body["reason"] == "no healthy upstream for deployment 'default'"
        assert body["deployments"][0]["ready"] is False
        assert only_upstream(body)["healthy"] is False
        assert only_upstream(body)["reason"] == "connect failed: connection refused"
        runner = await serve_on(port, up)
        body = await until_readyz(sc, 200)
        assert only_upstream(body)["healthy"] is True
        assert up.received == []  # the probe connects and sends nothing: no request reached the upstream
    finally:
        await runner.cleanup()


async def test_a_failed_connection_turns_readiness_off_at_once_and_an_answer_back_on(start_sidecar, monkeypatch):
    monkeypatch.setattr(health, "PROBE_INTERVAL_SECONDS", 3600.0)  # one probe at start, then traffic only
    port = free_port()
    up = RecordingUpstream()
    runner = await serve_on(port, up)
    sc = await start_sidecar(upstream=f"http://127.0.0.1:{port}", mode="dynamo_headers")
    try:
        await until_readyz(sc, 200)
        await runner.cleanup()
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{sc.proxy_url}/x") as resp:
                assert resp.status == 502
            status, body = await readyz(sc)
            assert status == 503, body
            assert only_upstream(body)["reason"] == "a request could not connect: connection refused"
            runner = await serve_on(port, up)
            async with s.get(f"{sc.proxy_url}/x") as resp:
                assert resp.status == 200
            status, body = await readyz(sc)
            assert status == 200 and only_upstream(body)["reason"] == "answered a request", body
    finally:
        await runner.cleanup()


async def test_active_health_checks_decide_readiness(raw_upstream, start_sidecar):
    healthy = {"now": False}

    async def check(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(OK if healthy["now"] else b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        return True

    up = await raw_upstream({"/health": check})
    sc = await start_sidecar(
        deployments=[
            {
                "name": "chat",
                "upstreams": [up.url],
                "mode": "dynamo_headers",
                "health_check": {"path": "/health", "interval_seconds": 0.05},
            }
        ]
    )
    body = await until(sc, lambda _, b: only_upstream(b)["reason"] != health.NOT_CHECKED)
    assert only_upstream(body)["checked_by"] == "health_check"
    assert only_upstream(body)["reason"] == "GET /health: answered 503"
    assert (await readyz(sc))[0] == 503 and body["reason"] == "no healthy upstream for deployment 'chat'"
    healthy["now"] = True
    body = await until_readyz(sc, 200)
    assert only_upstream(body) | {"since": None} == {
        "index": 0,
        "healthy": True,
        "checked_by": "health_check",
        "reason": "GET /health: answered 200",
        "since": None,
    }


async def test_every_deployment_needs_a_healthy_upstream(upstream, start_sidecar, monkeypatch):
    monkeypatch.setattr(health, "PROBE_INTERVAL_SECONDS", 0.1)
    dead = f"http://127.0.0.1:{free_port()}"
    sc = await start_sidecar(
        deployments=[
            {"name": "chat", "upstreams": [dead, upstream.url], "mode": "dynamo_headers"},
            {"name": "agents", "upstreams": [dead], "mode": "smg_routing_key"},
        ]
    )
    body = await until(
        sc,
        lambda _, b: (
            b["deployments"][0]["upstreams"][1]["healthy"]
            and all(u["reason"] != health.NOT_CHECKED for d in b["deployments"] for u in d["upstreams"])
        ),
    )
    # One healthy upstream is enough for chat; agents has none.
    assert (await readyz(sc))[0] == 503
    assert body["reason"] == "no healthy upstream for deployment 'agents'"
    assert [(d["name"], d["ready"], [u["healthy"] for u in d["upstreams"]]) for d in body["deployments"]] == [
        ("chat", True, [False, True]),
        ("agents", False, [False]),
    ]
    assert dead not in str(body) and upstream.url not in str(body)  # upstreams by index only


@pytest.mark.parametrize("required", [True, False])
async def test_draining_is_503_with_its_own_reason(upstream, start_sidecar, required):
    sc = await start_sidecar(upstream=upstream.url, readiness_check_upstream=required)
    await until_readyz(sc, 200)
    sc.health.draining = True  # what Sidecar.shutdown does first
    status, body = await readyz(sc)
    assert (status, body["status"]) == (503, "draining")
    assert body["reason"].startswith("shutting down")
