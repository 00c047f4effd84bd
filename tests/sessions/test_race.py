"""A close racing with 50 concurrent streaming requests on one strict API session.

Linearizable: a request admitted before the close returned streams to its end; every request
sent after the close returned is answered 410 and never reaches the upstream.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from tests.sessions.support import Api, deployment, fetch_spec

CHUNKS = 5
GAP = 0.04
REQUESTS = 50


class StampingUpstream:
    """An SSE upstream that records when each request (by X-Request-ID) arrived."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}
        self.session_headers: set[str] = set()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.arrived[request.headers["X-Request-ID"]] = time.monotonic()
        self.session_headers.add(request.headers.get("X-Dynamo-Session-ID", ""))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(CHUNKS):
            await resp.write(b"data: %d\n\n" % i)
            await asyncio.sleep(GAP)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def test_close_races_with_streaming_requests(launch, http):
    up = StampingUpstream()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", up.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        sc = await launch(deployments=[deployment("agents", url, strict=True, mode="dynamo_headers")])
        api = Api(http, sc.admin_url, await fetch_spec(http, sc.admin_url))
        await api.create(deployment="agents", session_id="raced")
        results: dict[str, tuple[float, int, bytes]] = {}

        async def one(i: int, client: aiohttp.ClientSession, delay: float = 0.0) -> None:
            await asyncio.sleep(delay)
            rid = f"r{i}"
            sent = time.monotonic()
            async with client.post(
                sc.proxy_url + "/v1/chat/completions",
                data=b"{}",
                headers={"X-Correlation-ID": "raced", "X-Request-ID": rid},
            ) as resp:
                results[rid] = (sent, resp.status, await resp.read())

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
            # a first wave streams; once some arrived, a second wave races with the close;
            # a last wave is sent after the close returned
            first = [asyncio.create_task(one(i, client, i * 0.002)) for i in range(20)]
            for _ in range(1000):
                if len(up.arrived) >= 8:
                    break
                await asyncio.sleep(0.005)
            racing = [asyncio.create_task(one(i, client, (i - 20) * 0.0005)) for i in range(20, 45)]
            status, body = await api.close("raced")
            closed_at = time.monotonic()
            assert status == 200 and body["status"] == "closed"
            await asyncio.gather(*(one(i, client) for i in range(45, REQUESTS)), *first, *racing)

        ok = {rid for rid, (_, status, _) in results.items() if status == 200}
        refused = {rid for rid, (_, status, _) in results.items() if status == 410}
        assert ok | refused == set(results) and len(results) == REQUESTS
        assert ok and refused, "the close did not land while requests were arriving"
        # in-flight ones finished completely
        expected = b"".join(b"data: %d\n\n" % i for i in range(CHUNKS)) + b"data: [DONE]\n\n"
        assert all(results[rid][2] == expected for rid in ok)
        # only admitted requests reached the upstream, each carrying the validated id
        assert set(up.arrived) == ok and up.session_headers == {"raced"}
        # none started after the close returned: every request sent after it was refused, and
        # every upstream arrival after it belongs to a request sent (admitted) before it
        assert all(results[rid][1] == 410 for rid, (sent, _, _) in results.items() if sent > closed_at)
        assert all(results[rid][0] < closed_at for rid, arrived in up.arrived.items() if arrived > closed_at)
        assert any(sent > closed_at for sent, _, _ in results.values())
        # the lineage session ended once, after its last in-flight request
        node = sc.router.tree.get("raced")
        assert node is None or node["in_flight"] == 0
        assert sc.router.tree.is_closed("raced") and sc.router.store.get("raced").in_flight == 0
    finally:
        await runner.cleanup()
