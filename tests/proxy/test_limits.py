"""Every resource a client can hold is bounded in bytes and in time, on both engines: a request
head must arrive within ``head_timeout_seconds``, a body a mode reads within the deployment's
timeouts, and session ids are kept and forwarded in at most ``sessions.max_id_bytes``."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from tests.engine import closed_soon, read_response

ONE_TURN = {"readiness_check_upstream": False}


async def _response_or_close(reader: asyncio.StreamReader) -> tuple[int, dict, bool]:
    """The proxy's answer, and whether it then closed (after lingering over unread bytes)."""
    async with asyncio.timeout(10):
        resp = await read_response(reader)
    return resp.status, orjson.loads(resp.body), await closed_soon(reader, 5)


async def _dribble(writer: asyncio.StreamWriter) -> None:
    """One more byte of a head every 0.1 s, until the peer closes."""
    try:
        while True:
            await asyncio.sleep(0.1)
            writer.write(b"a")
    except (ConnectionError, RuntimeError):
        return


@pytest.mark.parametrize("head", [b"GET /slow HTTP/1.1\r\nHost: x\r\nX-A: ", b"GET /p"])
async def test_a_head_dribbled_byte_by_byte_is_timed_out(head, upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, head_timeout_seconds=0.5, **ONE_TURN)
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.engine.port)
    writer.write(head)
    task = asyncio.create_task(_dribble(writer))
    try:
        status, body, closed = await _response_or_close(reader)
    finally:
        task.cancel()
        writer.close()
    assert status == 408 and closed
    assert body["error"]["type"] == "request_timeout"
    assert upstream.received == []
    reg = sc.metrics.registry
    assert reg.get_sample_value("sidecar_rejected_requests_total", {"reason": "request_timeout"}) == 1


HTTP09 = {"error": {"type": "bad_request", "message": "unsupported HTTP version 0.9"}}


@pytest.mark.parametrize(
    "pieces",
    [
        [b"GET /v1/models\r\n"],  # an HTTP/0.9 request: the line, nothing more
        [b"GET /v1/models\n"],
        [b"\r\nGET /v1/models\r\n"],  # (an empty line before a request is skipped)
        [b"GET /v1/mod", b"els\r", b"\n"],  # the line in pieces
        [b"GET /v1/models\r\nHost: x\r\n"],  # header lines after it: still no version
        [b"GET /v1/models HTTP/0.9\r\nHost: x\r\n"],
    ],
)
async def test_a_request_line_without_a_version_is_refused_as_it_ends(pieces, upstream, start_sidecar):
    """Not held until the head timeout (30 s here): the answer comes long before it."""
    sc = await start_sidecar(upstream=upstream.url, head_timeout_seconds=30, **ONE_TURN)
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.engine.port)
    try:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.02)  # (so that the pieces tend to arrive as separate reads)
        async with asyncio.timeout(10):
            resp = await read_response(reader)
        closed = await closed_soon(reader, 5)
    finally:
        writer.close()
    assert resp.start == "HTTP/1.1 400 Bad Request" and closed
    assert orjson.loads(resp.body) == HTTP09
    assert upstream.received == []
    reg = sc.metrics.registry
    assert reg.get_sample_value("sidecar_rejected_requests_total", {"reason": "bad_request"}) == 1


async def test_a_request_line_without_a_version_after_a_request_is_refused_as_it_ends(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, head_timeout_seconds=30, **ONE_TURN)
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.engine.port)
    try:
        writer.write(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(10):
            assert (await read_response(reader)).status == 200
        writer.write(b"GET /v1/models\r\n")
        async with asyncio.timeout(10):
            resp = await read_response(reader)
        closed = await closed_soon(reader, 5)
    finally:
        writer.close()
    assert (resp.status, orjson.loads(resp.body), closed) == (400, HTTP09, True)
    assert [r.path for r in upstream.received] == ["/first"]


async def test_a_kept_alive_connection_gets_a_fresh_head_timeout_per_request(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, head_timeout_seconds=0.6, **ONE_TURN)
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.engine.port)
    for i in range(3):  # each head in two pieces, the whole exchange longer than one timeout
        writer.write(b"GET /a%d HTTP/1.1\r\nHo" % i)
        await asyncio.sleep(0.25)
        writer.write(b"st: x\r\n\r\n")
        async with asyncio.timeout(5):
            assert (await read_response(reader)).status == 200
    writer.close()
    assert [r.path for r in upstream.received] == ["/a0", "/a1", "/a2"]


async def test_a_stalled_body_of_a_body_mode_is_timed_out_and_releases_the_session(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_nvext", timeouts={"idle": 0.5}, **ONE_TURN)
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.engine.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Correlation-ID: stall-1\r\n"
        b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model": "m",'
    )
    try:
        status, body, closed = await _response_or_close(reader)
    finally:
        writer.close()
    assert status == 408 and closed
    assert body["error"]["type"] == "request_timeout"
    assert upstream.received == []
    node = sc.router.tree.get("stall-1")
    assert node is None or node["in_flight"] == 0


async def test_long_session_ids_are_kept_and_forwarded_fitted(raw_upstream, start_sidecar):
    upstream = await raw_upstream()
    sc = await start_sidecar(
        upstream=upstream.url, mode="session_id_header", sessions={"max_id_bytes": 256}, **ONE_TURN
    )
    long_id = "agent/" + "x" * 30_000
    long_parent = "parent/" + "y" * 30_000
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.engine.port)
    for _ in range(2):
        writer.write(
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Correlation-ID: %s\r\nX-Parent-Session-ID: %s\r\n\r\n"
            % (long_id.encode(), long_parent.encode())
        )
        async with asyncio.timeout(5):
            assert (await read_response(reader)).status == 200
    writer.close()
    sent = [r.header("X-Session-ID") for r in upstream.received]
    assert sent[0] == sent[1] and len(sent[0].encode()) <= 256 and sent[0].startswith("agent/xxx")
    tree = sc.router.tree
    node = tree.get(sent[0])
    assert node is not None and node["turns"] == 2
    assert len(node["parent"].encode()) <= 256 and node["parent"].startswith("parent/yyy")
    assert all(len(s.encode()) <= 256 for s in tree._nodes)


async def test_a_body_signal_id_with_a_line_break_is_forwarded_opaque_never_injected(upstream, start_sidecar):
    sc = await start_sidecar(
        upstream=upstream.url, mode="dynamo_headers", identity={"body": ["prompt_cache_key"]}, **ONE_TURN
    )
    body = orjson.dumps({"model": "m", "prompt_cache_key": "conv-1\r\nX-Injected: yes\r\n\r\nGET /evil HTTP/1.1"})
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.engine.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    async with asyncio.timeout(5):
        assert (await read_response(reader)).status == 200
    writer.close()
    await asyncio.sleep(0.1)  # a smuggled second request would reach the upstream here
    assert len(upstream.received) == 1
    got = upstream.received[0]
    assert got.header("X-Injected") is None
    session = got.header("X-Dynamo-Session-ID")
    assert session is not None and session.startswith("~") and "\r" not in session and "\n" not in session


@pytest.mark.parametrize("control", ["\x0b", "\x0c", "\x1b", "\x7f", "\x01"])
async def test_a_body_signal_id_with_any_control_character_is_forwarded_opaque(upstream, start_sidecar, control):
    # RFC 9110 allows no control character but HTAB in a field value; this sidecar's own parser
    # refuses them in a client's header, so it must not send them to a gateway either.
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers", identity={"body": ["user"]}, **ONE_TURN)
    async with aiohttp.ClientSession() as http:
        for user in (f"s{control}X-Admin: 1", "tab\there"):
            async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m", "user": user}) as resp:
                assert resp.status == 200
    opaque, kept = (r.header("X-Dynamo-Session-ID") for r in upstream.received)
    assert opaque is not None and opaque.startswith("~") and opaque.isprintable()
    assert kept == "tab\there"  # HTAB is a field value's own character: kept as sent


async def test_admin_connections_without_a_whole_head_in_time_are_closed(upstream, start_sidecar):
    """The admin listener bounds what a connection can hold too: one that sends nothing, and one
    that dribbles a head, are closed once the head timeout passes; one that asks in time is
    answered, again after an idle pause shorter than the timeout."""
    sc = await start_sidecar(upstream=upstream.url, head_timeout_seconds=0.6, **ONE_TURN)
    port = int(sc.admin_url.rsplit(":", 1)[1])
    silent_r, silent_w = await asyncio.open_connection("127.0.0.1", port)
    slow_r, slow_w = await asyncio.open_connection("127.0.0.1", port)
    slow_w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: ")
    task = asyncio.create_task(_dribble(slow_w))
    ok_r, ok_w = await asyncio.open_connection("127.0.0.1", port)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        for _ in range(2):
            ok_w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(5):
                assert (await read_response(ok_r)).status == 200
            await asyncio.sleep(0.35)
        assert await closed_soon(silent_r, 5) and await closed_soon(slow_r, 5)
        assert loop.time() - started >= 0.55  # not before the timeout
    finally:
        task.cancel()
        for w in (silent_w, slow_w, ok_w):
            w.close()
