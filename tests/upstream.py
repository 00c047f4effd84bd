"""A recording fake upstream for wire tests: real aiohttp server on 127.0.0.1.

Every request it receives is recorded exactly (method, raw path, raw header list in order,
body bytes). Behaviour per path:
  /sse?chunks=N&gap=S   SSE stream: N events, S seconds apart (records when each was sent)
  /gzip                 a gzip-encoded body with Content-Encoding: gzip (never decoded)
  /slow?delay=S         waits S seconds before answering
  /hop                  answers with hop-by-hop headers that must not reach the client
  /status/<code>        answers with that status and a JSON body
  anything else         200 JSON echo of what was received
"""

from __future__ import annotations

import asyncio
import gzip
import time
from dataclasses import dataclass, field

import orjson
from aiohttp import web

GZIP_PAYLOAD = gzip.compress(b'{"hello": "compressed world"}' * 50)


@dataclass
class Received:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    at: float = field(default_factory=time.monotonic)  # when the upstream had read the request

    def header(self, name: str) -> str | None:
        vals = self.all(name)
        return vals[0] if vals else None

    def all(self, name: str) -> list[str]:
        low = name.lower()
        return [v for k, v in self.headers if k.lower() == low]

    def json(self) -> object:
        return orjson.loads(self.body)


@dataclass
class RecordingUpstream:
    received: list[Received] = field(default_factory=list)
    sse_sent_at: list[float] = field(default_factory=list)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""
    max_body_seen: int = 0
    peers: set[tuple[str, int]] = field(default_factory=set)
    # /finish_session answers 503 this many times before succeeding (retry tests).
    finish_failures: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if request.transport is not None:
            self.peers.add(request.transport.get_extra_info("peername")[:2])
        if path == "/big":
            # Count a large streamed body without keeping it.
            n = 0
            async for chunk in request.content.iter_any():
                n += len(chunk)
            self.max_body_seen = max(self.max_body_seen, n)
            self.received.append(Received(request.method, request.raw_path, _raw_headers(request), b""))
            return web.json_response({"bytes": n})
        body = await request.read()
        rec = Received(request.method, request.raw_path, _raw_headers(request), body)
        self.received.append(rec)
        if path == "/sse":
            return await self._sse(request)
        if path == "/gzip":
            return web.Response(
                body=GZIP_PAYLOAD, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}
            )
        if path == "/slow":
            await asyncio.sleep(float(request.query.get("delay", "5")))
            return web.json_response({"slow": True})
        if path == "/hop":
            resp = web.Response(text="ok")
            resp.headers["Keep-Alive"] = "timeout=5"
            resp.headers["Connection"] = "X-Private-Hop, keep-alive"
            resp.headers["X-Private-Hop"] = "secret"
            resp.headers["Proxy-Authenticate"] = "Basic"
            resp.headers["X-End-To-End"] = "kept"
            return resp
        if path == "/finish_session":
            if self.finish_failures > 0:
                self.finish_failures -= 1
                return web.json_response({"status": "busy"}, status=503)
            return web.json_response({"status": "ok"})
        if path == "/worker":
            # Names the worker that served the request the way gateways do (?w=<worker>).
            w = request.query.get("w", "w1")
            return web.json_response({"worker": w}, headers={"x-smg-routed-worker-id": w, "X-Worker-Id": w})
        if path == "/llmd":
            # An endpoint picker that hands out a session token (?token=<token>, or none).
            token = request.query.get("token")
            return web.json_response({"ok": True}, headers={"x-session-token": token} if token else None)
        if path.startswith("/status/"):
            return web.json_response({"status": int(path.rsplit("/", 1)[1])}, status=int(path.rsplit("/", 1)[1]))
        return web.json_response({"path": request.raw_path, "method": request.method, "bytes": len(body)})

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        n = int(request.query.get("chunks", "3"))
        gap = float(request.query.get("gap", "0.2"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            for i in range(n):
                self.sse_sent_at.append(time.monotonic())
                await resp.write(b"data: " + orjson.dumps({"i": i}) + b"\n\n")
                await asyncio.sleep(gap)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        return resp


def _raw_headers(request: web.Request) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.raw_headers]


async def start_upstream(up: RecordingUpstream) -> web.AppRunner:
    app = web.Application(client_max_size=1024**3)
    app.router.add_route("*", "/{tail:.*}", up.handle)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    up.url = f"http://127.0.0.1:{port}"
    return runner
