"""Long response bodies read and written without the transports (sidecar.engine.direct, compiled
build): on the wire nothing differs. Every test checks the path was taken (the engine's
DirectReads counts enrolments and reads) and then what the client and the upstream saw: exact
bytes, the connection reused after a clean end, closes and resets carried through, backpressure
holding with a client that does not read."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import pytest

from sidecar.engine.direct import ENROLL_AFTER, DirectReads
from tests.engine import (
    CUT_DATA,
    CUT_STREAM,
    CUT_THROUGH,
    Handler,
    RawMessage,
    closed_soon,
    echo,
    read_response,
    reset,
)
from tests.waiting import wait_for as until

pytestmark = [
    pytest.mark.skipif(DirectReads is None, reason="direct socket I/O is compiled only"),
    pytest.mark.parametrize("engine", ["fast"]),
]

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = 3 * ENROLL_AFTER + 6  # well past enrolment


def event(i: int) -> bytes:
    data = b'data: {"i":%d,"delta":"tok"}\n\n' % i
    return b"%x\r\n%s\r\n" % (len(data), data)


def paced(parts: list[bytes], pause: float = 0.01, *, close: bool = False) -> Handler:
    """Each part in a write of its own, ``pause`` apart (one read each at the proxy); with
    ``close``, the connection closes after the last part."""

    async def handle(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause)
        return not close

    return handle


async def open_stream(sc: Any, target: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", int(sc.engine.port))
    writer.write(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % target)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    return reader, writer, head


async def read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body up to its last chunk (the connection stays open)."""
    got = bytearray()
    async with asyncio.timeout(10):
        while not got.endswith(b"0\r\n\r\n"):
            chunk = await reader.read(65536)
            assert chunk, bytes(got)
            got += chunk
    return bytes(got)


async def stream_metrics(sc: Any) -> dict[str, float]:
    """The stream-read samples of the sidecar's ``/metrics`` (name -> value)."""
    async with aiohttp.ClientSession() as s, s.get(f"{sc.admin_url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    got = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith(("sidecar_stream_", "sidecar_streams_")):
            got[name] = float(value)
    return got


async def read_all(reader: asyncio.StreamReader, timeout: float = 10) -> bytes:
    """Everything until the peer closes (or resets)."""
    got = bytearray()
    try:
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                got += chunk
    except ConnectionResetError:
        pass
    return bytes(got)


async def test_a_long_stream_is_read_directly_byte_exact_and_its_connection_is_reused(
    raw_upstream: Any, start_sidecar: Any
) -> None:
    body = [event(i) for i in range(EVENTS)] + [b"0\r\n\r\n"]
    up = await raw_upstream({"/s": paced([SSE_HEAD, *body]), "/after": echo()})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False)
    reader, writer, head = await open_stream(sc, b"/s")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    got = await read_chunked(reader)
    assert got == b"".join(body)  # passed through exactly as the upstream framed it
    direct = sc.engine.direct
    assert direct.enrolled == 1
    # The reads after enrolment came through the epoll set (the last chunk's included; fewer
    # reads when writes of the upstream arrived together).
    reads = direct.reads
    assert 1 <= reads <= len(body) - ENROLL_AFTER
    # The connection went back to its transport: the next request reads its answer there.
    writer.write(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
    after = await asyncio.wait_for(read_response(reader), 5)
    writer.close()
    assert after.status == 200
    assert up.connections == 1 and [r.conn for r in up.received] == [1, 1]
    assert direct.enrolled == 1 and direct.reads == reads  # the short answer was not enrolled


async def test_a_streams_events_and_its_end_are_relayed_by_the_thread(raw_upstream: Any, start_sidecar: Any) -> None:
    """Events 1 ms apart, one chunk each: after enrolment every read is relayed by the stream
    thread, the last chunk included, and the loop is handed the connection back once, to end
    the response."""
    body = [event(i) for i in range(4 * EVENTS)] + [b"0\r\n\r\n"]
    up = await raw_upstream({"/s": paced([SSE_HEAD, *body], 0.001)})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False)
    reader, writer, _ = await open_stream(sc, b"/s")
    assert await read_chunked(reader) == b"".join(body)
    writer.close()
    direct = sc.engine.direct
    await until(lambda: direct.handed_back == 1)  # (just after the thread wrote the last chunk)
    assert direct.enrolled == 1 and direct.reads > 0 and direct.handed_back == 1
    # What an operator sees.
    assert await stream_metrics(sc) == {
        "sidecar_streams_read_directly_total": 1,
        "sidecar_stream_reads_total": direct.reads,
        "sidecar_stream_handbacks_total": 1,
    }


async def test_many_concurrent_streams_are_relayed_byte_exact(raw_upstream: Any, start_sidecar: Any) -> None:
    """40 concurrent streams of an event every 40 ms, started a millisecond apart: every client
    gets exactly its upstream's bytes, each stream goes back to the loop once (at its end), and
    the connections go back to the pool."""
    count = 40
    body = [event(i) for i in range(EVENTS)] + [b"0\r\n\r\n"]
    up = await raw_upstream({"/s": paced([SSE_HEAD, *body], 0.04), "/after": echo()})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False)
    opened = []
    for _ in range(count):
        opened.append(await open_stream(sc, b"/s"))
        await asyncio.sleep(0.001)  # spread over the gap, as streams that started apart
    bodies = await asyncio.gather(*(read_chunked(reader) for reader, _, _ in opened))
    assert bodies == [b"".join(body)] * count
    direct = sc.engine.direct
    # The thread hands a stream back just after writing its last chunk, which its client may read first.
    await until(lambda: direct.handed_back == count)
    assert direct.enrolled == count and direct.handed_back == count
    assert direct.reads >= count * (len(body) - ENROLL_AFTER - 1) // 2  # (two events may share a read)
    reader, writer, _ = opened[0]
    writer.write(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await asyncio.wait_for(read_response(reader), 5)).status == 200
    for _, writer, _ in opened:
        writer.close()
    assert up.connections == count


async def test_a_body_delimited_by_the_upstreams_close_ends_cleanly_after_enrolment(
    raw_upstream: Any, start_sidecar: Any
) -> None:
    """The close is met by the transport once the connection leaves the epoll set: the client
    gets every byte and the last chunk, on a connection that stays open."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"  # no length, not chunked
    parts = [b"data: %d\n\n" % i for i in range(EVENTS)]
    up = await raw_upstream({"/s": paced([head, *parts], close=True), "/after": echo()})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False)
    reader, writer, got_head = await open_stream(sc, b"/s")
    assert b"transfer-encoding: chunked" in got_head.lower()
    got = await read_chunked(reader)
    assert got == b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    assert sc.engine.direct.enrolled == 1 and 1 <= sc.engine.direct.reads <= len(parts) - ENROLL_AFTER
    writer.write(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await asyncio.wait_for(read_response(reader), 5)).status == 200
    writer.close()


async def test_an_upstream_that_closes_mid_stream_after_enrolment_aborts_the_client(
    raw_upstream: Any, start_sidecar: Any
) -> None:
    body = [event(i) for i in range(EVENTS)]  # no last chunk: the body is cut short
    up = await raw_upstream({"/s": paced([SSE_HEAD, *body], close=True)})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False)
    reader, writer, _ = await open_stream(sc, b"/s")
    got = await read_all(reader)
    writer.close()
    assert got == b"".join(body)  # every event, and no last chunk: the client can tell
    assert sc.engine.direct.enrolled == 1
    errors = sc.metrics.registry.get_sample_value(
        "sidecar_upstream_errors_total", {"deployment": "default", "kind": "reset"}
    )
    assert errors == 1.0
    assert sc.engine.stats()["upstream_connections"] == 0


def reset_when(parts: list[bytes], go: asyncio.Event, pause: float = 0.01) -> Handler:
    """Each part in a write of its own, ``pause`` apart, then a reset (not a close) once ``go``
    is set: the test sets it when the client has every part, so the reset never overtakes a part
    the proxy has not read yet (the kernel drops unread bytes when a reset arrives)."""

    async def handle(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await paced(parts, pause)(req, reader, writer)
        await go.wait()
        reset(writer)
        return False

    return handle


@pytest.mark.parametrize("framing", ["close", "chunked"])
async def test_an_upstream_reset_mid_stream_after_enrolment_aborts_the_client(
    raw_upstream: Any, start_sidecar: Any, framing: str
) -> None:
    """The thread's read takes the reset from the socket; the response still fails with it.
    Without that, the transport would read a clean close next, and a body the upstream's close
    delimits would end with a last chunk, as if complete: a cut answer the client takes as whole."""
    if framing == "close":
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"  # no length, not chunked
        parts = [b"data: %d\n\n" % i for i in range(EVENTS)]
        relayed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    else:
        head, parts = SSE_HEAD, [event(i) for i in range(EVENTS)]
        relayed = b"".join(parts)
    go = asyncio.Event()
    up = await raw_upstream({"/s": reset_when([head, *parts], go)})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False)
    reader, writer, _ = await open_stream(sc, b"/s")
    got = await asyncio.wait_for(reader.readexactly(len(relayed)), 10)
    go.set()
    rest = await read_all(reader)
    writer.close()
    assert got == relayed and rest == b""  # every event and no last chunk: the client can tell the answer is cut
    assert sc.engine.direct.enrolled == 1
    await until(
        lambda: (
            sc.metrics.registry.get_sample_value(
                "sidecar_upstream_errors_total", {"deployment": "default", "kind": "reset"}
            )
            == 1.0
        )
    )
    assert sc.engine.stats()["upstream_connections"] == 0


async def test_malformed_framing_after_enrolment_aborts_the_client_and_relays_nothing_of_it(
    raw_upstream: Any, start_sidecar: Any
) -> None:
    body = [event(i) for i in range(EVENTS)]
    up = await raw_upstream({"/s": paced([SSE_HEAD, *body, b"zz\r\nevil\r\n"])})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False)
    reader, writer, _ = await open_stream(sc, b"/s")
    got = await read_all(reader)
    writer.close()
    assert got == b"".join(body)
    assert sc.engine.direct.enrolled == 1
    assert sc.engine.stats()["upstream_connections"] == 0


async def test_a_client_that_leaves_mid_stream_closes_the_upstream_connection(
    raw_upstream: Any, start_sidecar: Any
) -> None:
    """The upstream must learn at once that nobody reads its stream (it stops generating)."""
    up_side: dict[str, asyncio.StreamReader] = {}

    async def endless(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        up_side["reader"] = reader
        writer.write(SSE_HEAD)
        i = 0
        try:
            while True:
                writer.write(event(i))
                await writer.drain()
                i += 1
                await asyncio.sleep(0.01)
        except (ConnectionResetError, BrokenPipeError):
            return False

    up = await raw_upstream({"/s": endless})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False)
    reader, writer, _ = await open_stream(sc, b"/s")
    got = bytearray()
    async with asyncio.timeout(10):
        while got.count(b"data: ") < EVENTS:
            got += await reader.read(65536)
    assert sc.engine.direct.enrolled == 1 and sc.engine.direct.reads > 0
    writer.transport.abort()
    # The sidecar closes its upstream connection: the upstream reads EOF (or a reset).
    assert await closed_soon(up_side["reader"], 5)
    async with asyncio.timeout(5):
        while sc.engine.stats()["upstream_connections"]:
            await asyncio.sleep(0.01)


async def test_a_client_that_does_not_read_gets_backpressure_then_every_byte(
    raw_upstream: Any, start_sidecar: Any
) -> None:
    """A stream far larger than the socket buffers, to a client that reads until the stream
    thread relays it, then stops: the thread meets the full socket and hands the rest back, the
    sidecar buffers at most about its high-water mark (the upstream's reads pause), and the
    client then gets the stream byte-exact."""
    blob = bytes(range(256)) * 256  # 64 KiB chunks
    chunk = b"%x\r\n%s\r\n" % (len(blob), blob)
    count = 512  # 32 MiB: more than the loopback socket buffers on both sides can hold
    done = asyncio.Event()

    async def big(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(SSE_HEAD)
        for i in range(count):
            writer.write(chunk)
            await writer.drain()
            if i < 2 * ENROLL_AFTER:  # paced at first (the stream is enrolled meanwhile), then all at once
                await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        done.set()
        return True

    up = await raw_upstream({"/s": big})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False)
    reader, writer, _ = await open_stream(sc, b"/s")
    got = bytearray()
    async with asyncio.timeout(60):
        while sc.engine.direct.enrolled == 0 or len(got) < 4 * len(chunk):  # the stream thread relays it
            data = await reader.read(1 << 20)
            assert data
            got += data
    # The client reads nothing for a while: everything in flight stays in bounded buffers.
    await asyncio.sleep(0.5)
    assert not done.is_set()  # the upstream is held back: nothing reads it
    assert sc.engine.stats()["client_write_buffer"] <= 1 << 20
    assert sc.engine.direct.handed_back >= 1  # the thread met the full socket and handed the rest back
    async with asyncio.timeout(60):
        while not got.endswith(b"0\r\n\r\n") or len(got) < count * len(chunk):
            data = await reader.read(1 << 20)
            assert data
            got += data
    writer.close()
    assert got == chunk * count + b"0\r\n\r\n"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("version", ["1.1", "1.0"])
async def test_chunked_framing_cut_anywhere_after_enrolment_is_relayed_exactly(
    raw_upstream: Any, start_sidecar: Any, version: str, seed: int
) -> None:
    """The framing is tracked in the epoll set's own buffer: sizes, CRLFs, extensions and
    trailers split across reads arrive as through the transport (passed through to an HTTP/1.1
    client less extensions and trailers, dechunked for an HTTP/1.0 one)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(CUT_STREAM)), 12)) if seed else list(range(1, len(CUT_STREAM)))
    tail = [CUT_STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(CUT_STREAM)])]
    events = [event(i) for i in range(ENROLL_AFTER + 1)]
    up = await raw_upstream({"/s": paced([SSE_HEAD, *events, *tail])})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False)
    reader, writer = await asyncio.open_connection("127.0.0.1", int(sc.engine.port))
    writer.write(b"GET /s HTTP/%s\r\nHost: x\r\n\r\n" % version.encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/%s 200 OK\r\n" % version.encode())
    got = bytearray()
    async with asyncio.timeout(10):
        if version == "1.1":
            while not got.endswith(b"00\r\n\r\n"):
                chunk = await reader.read(65536)
                assert chunk, bytes(got)
                got += chunk
        else:  # close-delimited
            while chunk := await reader.read(65536):
                got += chunk
    writer.close()
    if version == "1.1":
        assert bytes(got) == b"".join(events) + CUT_THROUGH
    else:
        assert bytes(got) == b"".join(e.split(b"\r\n", 1)[1][:-2] for e in events) + CUT_DATA
    assert sc.engine.direct.enrolled == 1 and sc.engine.direct.reads >= 1


async def test_a_long_content_length_body_is_read_directly_byte_exact(raw_upstream: Any, start_sidecar: Any) -> None:
    parts = [bytes([i]) * (i * 37 % 500 + 1) for i in range(3 * ENROLL_AFTER)]
    body = b"".join(parts)
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
    up = await raw_upstream({"/s": paced([head, *parts]), "/after": echo()})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False)
    reader, writer, _ = await open_stream(sc, b"/s")
    got = await asyncio.wait_for(reader.readexactly(len(body)), 10)
    assert got == body
    assert sc.engine.direct.enrolled == 1 and sc.engine.direct.reads >= 1
    writer.write(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await asyncio.wait_for(read_response(reader), 5)).status == 200  # nothing after the body
    writer.close()
    assert up.connections == 1


async def test_where_the_stream_thread_cannot_start_streams_go_through_the_event_loop(
    raw_upstream: Any, start_sidecar: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A thread limit (or no descriptor left) at start: the sidecar starts anyway, says so, and
    relays streams through its transports, byte-exact."""

    def refuse(loop: Any) -> None:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr("sidecar.engine.fast.DirectReads", refuse)
    body = [event(i) for i in range(EVENTS)] + [b"0\r\n\r\n"]
    up = await raw_upstream({"/s": paced([SSE_HEAD, *body])})
    with caplog.at_level("WARNING", logger="sidecar.engine"):
        sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False)
    assert sc.engine.direct is None
    reader, writer, _ = await open_stream(sc, b"/s")
    assert await read_chunked(reader) == b"".join(body)
    writer.close()
    assert [r.getMessage() for r in caplog.records if r.name == "sidecar.engine"] == [
        "stream thread not started, streamed bodies go through the event loop: "
        "[Errno 11] Resource temporarily unavailable"
    ]


# -- prompt-cache usage of the streams the thread relays ------------------------------------------


async def session_stream(sc: Any, target: bytes, session: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", int(sc.engine.port))
    writer.write(b"GET %s HTTP/1.1\r\nHost: x\r\nX-Correlation-ID: %s\r\n\r\n" % (target, session.encode()))
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    return reader, writer


async def prompt_cache_of(sc: Any, session: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(f"{sc.admin_url}/v1/sessions/{session}") as r:
        assert r.status == 200
        return dict((await r.json())["prompt_cache"])


@pytest.mark.parametrize("split", [0, 1, 2], ids=["whole", "usage split", "usage split thrice"])
async def test_a_streams_usage_is_read_from_what_the_thread_relayed(
    raw_upstream: Any, start_sidecar: Any, split: int
) -> None:
    """A session's token stream, paced: the thread relays its events, its usage chunk (in one
    read, or cut across reads) and its last chunk; the usage counted is what that chunk said,
    from the bytes the thread kept (a body far longer than what is kept of its end)."""
    from sidecar.lineage import prompt_cache
    from tests import usage_samples as s

    payload = s.chat_stream(s.chat_usage(5000, 4096), words=300, text="token " * 20)
    body = s.chunked_by_event(payload)
    parts = [b"%x\r\n%s\r\n" % (len(e) + 2, e + b"\n\n") for e in payload.split(b"\n\n") if e]
    assert b"".join(parts) + b"0\r\n\r\n" == body and len(body) > 4 * 16384
    usage = next(i for i, p in enumerate(parts) if b'"usage":{' in p)
    if split:  # the usage chunk in pieces, each its own read
        piece = parts.pop(usage)
        cuts = [len(piece) * k // (split + 1) for k in range(split + 2)]
        parts[usage:usage] = [piece[a:b] for a, b in zip(cuts, cuts[1:])]
    up = await raw_upstream({"/s": paced([SSE_HEAD, *parts, b"0\r\n\r\n"], 0.002)})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False, mode="dynamo_headers")
    reader, writer = await session_stream(sc, b"/s", "thread-usage")
    assert await read_chunked(reader) == body  # byte for byte
    writer.close()
    direct = sc.engine.direct
    await until(lambda: direct.handed_back >= 1)
    assert direct.enrolled >= 1 and direct.reads >= 1  # the thread relayed the stream after its first read
    await until(lambda: sc.router.tree.get("thread-usage")["in_flight"] == 0)
    assert await prompt_cache_of(sc, "thread-usage") == prompt_cache(5000, 4096, 1, 0)


async def test_a_close_delimited_streams_usage_is_read_from_what_the_thread_relayed(
    raw_upstream: Any, start_sidecar: Any
) -> None:
    """A body the upstream's close ends: the thread relays its reads, the transport meets the
    close; the usage counted is what its last event said."""
    from sidecar.lineage import prompt_cache
    from tests import usage_samples as s

    payload = s.chat_stream(s.chat_usage(700, 512), words=40)
    parts = [e + b"\n\n" for e in payload.split(b"\n\n") if e]
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"  # no length, not chunked
    up = await raw_upstream({"/s": paced([head, *parts], 0.002, close=True)})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False, mode="dynamo_headers")
    reader, writer = await session_stream(sc, b"/s", "eof-usage")
    got = await read_chunked(reader)
    writer.close()
    assert got == b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    assert sc.engine.direct.enrolled == 1 and sc.engine.direct.reads >= 1
    await until(lambda: sc.router.tree.get("eof-usage")["in_flight"] == 0)
    assert await prompt_cache_of(sc, "eof-usage") == prompt_cache(700, 512, 1, 0)


async def test_a_stream_whose_client_leaves_is_not_counted(raw_upstream: Any, start_sidecar: Any) -> None:
    """A client that leaves mid-stream: its turn's usage is not counted (neither known nor unknown)."""
    from sidecar.lineage import prompt_cache

    body = [event(i) for i in range(EVENTS)]
    gate = asyncio.Event()

    async def stalls(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        for part in [SSE_HEAD, *body]:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.002)
        await gate.wait()
        return False

    up = await raw_upstream({"/s": stalls})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False, mode="dynamo_headers")
    reader, writer = await session_stream(sc, b"/s", "left")
    got = bytearray()
    async with asyncio.timeout(10):
        while len(got) < len(b"".join(body)):
            got += await reader.read(65536)
    writer.close()
    await until(lambda: sc.router.tree.get("left")["in_flight"] == 0)
    gate.set()
    assert await prompt_cache_of(sc, "left") == prompt_cache(0, 0, 0, 0)
