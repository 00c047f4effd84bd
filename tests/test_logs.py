"""Structured logs: one JSON object per line, request id and deployment on request events,
session ids only at debug level, never tokens or bodies."""

from __future__ import annotations

import asyncio
import io
import logging

import aiohttp
import orjson
import pytest

from sidecar import logs


@pytest.fixture
def capture():
    root = logging.getLogger()
    saved = (root.level, root.handlers[:])

    def start(level: str) -> io.StringIO:
        buf = io.StringIO()
        logs.setup(level)
        handler = root.handlers[0]
        assert isinstance(handler, logging.StreamHandler)
        handler.setStream(buf)
        return buf

    yield start
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]


def lines(buf: io.StringIO) -> list[dict]:
    return [orjson.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


async def test_moved_line_carries_request_id_and_deployment_not_session_at_info(upstream, start_sidecar, capture):
    buf = capture("info")
    sc = await start_sidecar(upstream=upstream.url, mode="smg_routing_key")
    async with aiohttp.ClientSession() as s:
        for i, w in enumerate(["a", "b"]):
            async with s.post(
                f"{sc.proxy_url}/worker?w={w}",
                data=b'{"secret": "prompt text"}',
                headers={
                    "X-Correlation-ID": "sess-private",
                    "X-Request-ID": f"req-{i}",
                    "Authorization": "Bearer sk-secret-token",
                },
            ) as resp:
                await resp.read()
    text = buf.getvalue()
    [moved] = [r for r in lines(buf) if r.get("event") == "moved"]
    assert moved["request_id"] == "req-1" and moved["deployment"] == "default"
    assert moved["level"] == "info" and moved["from_worker"] == "a" and moved["to_worker"] == "b"
    assert "sess-private" not in text
    assert "sk-secret-token" not in text and "prompt text" not in text


async def test_debug_access_log_names_the_session(upstream, start_sidecar, capture):
    buf = capture("debug")
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    async with aiohttp.ClientSession() as s:
        async with s.get(
            f"{sc.proxy_url}/status/201", headers={"X-Correlation-ID": "sess-d", "X-Request-ID": "r-42"}
        ) as resp:
            await resp.read()
    [access] = [r for r in lines(buf) if r.get("event") == "request"]
    assert access["level"] == "debug"
    assert (access["request_id"], access["session"], access["status"], access["outcome"]) == (
        "r-42",
        "sess-d",
        201,
        "completed",
    )
    assert access["deployment"] == "default" and access["mode"] == "dynamo_headers"


MALFORMED = [
    b"POST /v1/chat HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-secret-token-0123456789\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\nboom\r\n0\r\n\r\n",
    b"GET /v1/chat HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-secret-token-0123456789\r\nBad Header: x\r\n\r\n",
    b"GET /v1/chat HTTP/1.1\r\nHost: user@sk-secret-token-0123456789\r\n\r\n",
    b"GET /v1/chat HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-secret-token-0123456789\x01\r\n\r\n",
]


@pytest.mark.parametrize("data", MALFORMED)
async def test_malformed_requests_never_log_their_bytes(data, upstream, start_sidecar, capture):
    buf = capture("debug")  # not even at debug: the refusal names the error class only
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.engine.port)
    writer.write(data)
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n", 1)[0]
    assert b"sk-secret-token" not in answer  # the error body never echoes the request
    logged = buf.getvalue()
    assert "sk-secret-token" not in logged
    assert upstream.received == []
