"""Prompt-cache usage read on the wire, on both engines: each API format streamed and not, its
body written by the upstream in two writes cut at every byte of the usage event, relayed to the
client byte for byte and counted for the session; without usage, malformed, content-encoded
(counted unknown, relayed untouched); and the opt-in request patch that asks for usage.

The engines hand the admission's usage reader the body's ends (``Admission.usage_reader``,
``UsageReader.first`` / ``last``, ``Admission.on_usage``; see ``sidecar/router.py``)."""

from __future__ import annotations

import asyncio
import gzip
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest

from sidecar.lineage import prompt_cache
from tests import usage_samples as s
from tests.engine import RawMessage, reset
from tests.modes.wire import settled

EVENT_STREAM, JSON = "text/event-stream", "application/json"


@dataclass
class Answer:
    """What the upstream writes for the next request: ``raw`` (the body with its framing) cut
    after ``cut`` bytes into two writes a few milliseconds apart."""

    raw: bytes = b""
    content_type: str = JSON
    chunked: bool = False
    cut: int = 0
    encoding: str | None = None


class UsageUpstream:
    """A raw upstream handler answering every request with the current :class:`Answer`."""

    def __init__(self) -> None:
        self.answer = Answer()
        self.requests: list[RawMessage] = []

    async def __call__(self, req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        self.requests.append(req)
        a = self.answer
        framing = b"Transfer-Encoding: chunked" if a.chunked else b"Content-Length: %d" % len(a.raw)
        coding = b"Content-Encoding: %s\r\n" % a.encoding.encode() if a.encoding else b""
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\n%s%s\r\n\r\n" % (a.content_type.encode(), coding, framing)
        )
        writer.write(a.raw[: a.cut])
        await writer.drain()
        await asyncio.sleep(0.002)  # the second write reaches the sidecar in another read
        writer.write(a.raw[a.cut :])
        await writer.drain()
        return True


@pytest.fixture
async def usage_upstream(raw_upstream: Any) -> Any:
    handler = UsageUpstream()
    up = await raw_upstream({"/v1/chat/completions": handler, "/v1/responses": handler, "/v1/messages": handler})
    up.handler = handler
    return up


async def ask(http: aiohttp.ClientSession, sc: Any, session: str, path: str = "/v1/chat/completions") -> bytes:
    """One request of ``session``; the body the client received."""
    async with http.post(sc.proxy_url + path, data=b'{"model":"m"}', headers={"X-Correlation-ID": session}) as resp:
        assert resp.status == 200
        body = await resp.read()
    await settled(sc, session)
    return body


async def counted(http: aiohttp.ClientSession, sc: Any, session: str) -> dict[str, Any]:
    async with http.get(f"{sc.admin_url}/v1/sessions/{session}") as resp:
        assert resp.status == 200
        return dict((await resp.json())["prompt_cache"])


# (name, path, body, content type, chunked, (prompt, cached)): each API format, streamed and not,
# streams chunked one event per chunk (as servers write them), JSON bodies with a length
FORMATS = [
    ("chat json", "/v1/chat/completions", s.DYNAMO_CHAT_JSON, JSON, False, (726, 704)),
    ("chat stream", "/v1/chat/completions", s.DYNAMO_CHAT_STREAM, EVENT_STREAM, True, (726, 704)),
    ("responses json", "/v1/responses", s.DYNAMO_RESPONSES_JSON, JSON, False, (707, 0)),
    (
        "responses stream",
        "/v1/responses",
        s.responses_stream(s.responses_usage(900, 640)),
        EVENT_STREAM,
        True,
        (900, 640),
    ),
    ("messages json", "/v1/messages", s.DYNAMO_MESSAGES_JSON, JSON, False, (720, 704)),
    (
        "messages stream",
        "/v1/messages",
        s.anthropic_stream(s.anthropic_usage(12, 400, 30), {"output_tokens": 9}),
        EVENT_STREAM,
        True,
        (442, 400),
    ),
]


def usage_event(raw: bytes) -> range:
    """The raw offsets of the last usage member's event (a JSON body: the member), a few bytes wider."""
    key = raw.rfind(b'"usage":{')
    assert key > 0
    if b"data:" in raw:
        start, end = raw.rfind(b"\n\n", 0, key), raw.find(b"\n\n", key)
    else:  # the member's object: to the brace closing it (usage holds no strings with braces)
        start, end, depth = key, key + len(b'"usage":'), 0
        while True:
            depth += {ord("{"): 1, ord("}"): -1}.get(raw[end], 0)
            end += 1
            if depth == 0:
                break
    assert start < end
    return range(max(start - 8, 0), min(end + 8, len(raw)) + 1)


@pytest.mark.parametrize(
    ("name", "path", "body", "content_type", "chunked", "counts"), FORMATS, ids=[f[0] for f in FORMATS]
)
async def test_usage_is_read_with_the_body_cut_at_every_byte_of_its_usage_event(
    name, path, body, content_type, chunked, counts, usage_upstream, start_sidecar
):
    sc = await start_sidecar(upstream=usage_upstream.url, mode="dynamo_headers")
    raw = s.chunked_by_event(body) if chunked else body
    if name == "messages stream":  # Anthropic's counts come first, in message_start
        cuts = [*usage_event(raw), *range(0, raw.find(b"\n\n") + 8)]
    else:
        cuts = list(usage_event(raw))
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        for n, cut in enumerate(cuts, 1):
            usage_upstream.handler.answer = Answer(raw, content_type, chunked, cut)
            assert await ask(http, sc, name, path) == body  # relayed byte for byte
            assert await counted(http, sc, name) == prompt_cache(counts[0] * n, counts[1] * n, n, 0), cut


async def test_a_response_without_usage_or_with_a_malformed_one_is_unknown_and_relayed_untouched(
    usage_upstream, start_sidecar
):
    sc = await start_sidecar(upstream=usage_upstream.url, mode="dynamo_headers")
    malformed = s.chat_usage(50, 40)
    malformed["prompt_tokens_details"]["cached_tokens"] = "forty"
    compressed = gzip.compress(s.DYNAMO_CHAT_JSON)
    answers = [
        Answer(s.chunked_by_event(s.DYNAMO_CHAT_STREAM_NO_USAGE), EVENT_STREAM, True, 100),
        Answer(s.chunked_by_event(s.chat_stream(malformed)), EVENT_STREAM, True, 100),
        Answer(s.chat_json(s.chat_usage(50, None)), JSON, False, 30),  # a prompt count alone
        Answer(compressed, JSON, False, 10, encoding="gzip"),
        Answer(s.chat_json(s.chat_usage(60, 30)), JSON, False, 30),
    ]
    relayed = [
        s.DYNAMO_CHAT_STREAM_NO_USAGE,
        s.chat_stream(malformed),
        s.chat_json(s.chat_usage(50, None)),
        compressed,
        s.chat_json(s.chat_usage(60, 30)),
    ]
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        for answer, body in zip(answers, relayed, strict=True):
            usage_upstream.handler.answer = answer
            assert await ask(http, sc, "unknowns") == body
        assert await counted(http, sc, "unknowns") == prompt_cache(60, 30, 1, 4)
        async with http.get(sc.admin_url + "/metrics") as resp:
            text = await resp.text()
    for outcome, n in (("missing", 1), ("malformed", 1), ("no_cached_count", 1), ("unreadable", 1), ("reported", 1)):
        assert (
            f'sidecar_usage_responses_total{{deployment="default",mode="dynamo_headers",outcome="{outcome}"}} {n}.0'
            in text
        )


async def test_a_long_stream_is_read_from_its_two_ends(usage_upstream, start_sidecar):
    """A body far longer than what the reader keeps of either end: its usage, last, still counts."""
    sc = await start_sidecar(upstream=usage_upstream.url, mode="dynamo_headers")
    body = s.chat_stream(s.chat_usage(9000, 8192), words=4000, text="token " * 8)
    usage_upstream.handler.answer = Answer(s.chunked_by_event(body), EVENT_STREAM, True, len(body) // 2)
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        assert await ask(http, sc, "long") == body
        assert await counted(http, sc, "long") == prompt_cache(9000, 8192, 1, 0)


async def test_include_usage_asks_streamed_chat_completions_for_their_usage(usage_upstream, start_sidecar):
    """Opt-in per deployment: the upstream gets ``stream_options.include_usage: true`` (the
    client's other members unchanged), the client the usage chunk it did not ask for, and the
    turn is counted."""
    sc = await start_sidecar(upstream=usage_upstream.url, mode="dynamo_headers", usage={"include_usage": True})
    usage_upstream.handler.answer = Answer(s.chunked_by_event(s.DYNAMO_CHAT_STREAM), EVENT_STREAM, True, 50)
    sent = b'{"model":"m","stream":true,"stream_options":{"continuous_usage_stats":false},"messages":[]}'
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        async with http.post(
            sc.proxy_url + "/v1/chat/completions", data=sent, headers={"X-Correlation-ID": "inj"}
        ) as resp:
            assert resp.status == 200 and await resp.read() == s.DYNAMO_CHAT_STREAM
        await settled(sc, "inj")
        assert await counted(http, sc, "inj") == prompt_cache(726, 704, 1, 0)
    forwarded = usage_upstream.handler.requests[-1].body
    assert forwarded == sent.replace(
        b'"continuous_usage_stats":false}', b'"continuous_usage_stats":false,"include_usage":true}'
    )
    assert orjson.loads(forwarded)["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}


@pytest.mark.parametrize(
    ("name", "path", "body", "content_type", "chunked", "counts"),
    [f for f in FORMATS if f[4]],
    ids=[f[0] for f in FORMATS if f[4]],
)
async def test_a_stream_written_event_by_event_is_read(
    name, path, body, content_type, chunked, counts, raw_upstream, start_sidecar
):
    """Each event, then the last chunk, in a write of its own a moment apart (a read each at the
    sidecar, as servers write them): the usage event, the ``[DONE]`` and the last chunk may
    each be a read of their own after the body's first reads."""
    chunks = [*s.event_chunks(body), b"0\r\n\r\n"]

    async def events(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n" % content_type.encode()
        )
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(0.002)  # (pacing: the verdict holds however the reads fall)
        return True

    up = await raw_upstream({path: events})
    sc = await start_sidecar(upstream=up.url, mode="dynamo_headers")
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        for n in (1, 2):
            assert await ask(http, sc, name, path) == body
            assert await counted(http, sc, name) == prompt_cache(counts[0] * n, counts[1] * n, n, 0)


# -- a response whose body did not end: counted when what was read of it reported its usage ------

CUT_COUNTS = (726, 704)
CUT_BODY = s.chat_stream(s.chat_usage(*CUT_COUNTS), words=6)
CUT_CHUNKS = s.event_chunks(CUT_BODY)  # (the body's last chunk is never written)


def _stream_then(written: int, ending: str) -> Any:
    """An upstream handler streaming the first ``written`` chunks of :data:`CUT_BODY`, each a
    write of its own a moment apart (the stream thread relays them, where there is one), then:
    ``hold`` (no more: it waits for the sidecar to close the connection), ``close`` (FIN) or
    ``reset`` (RST): never the body's last chunk."""

    async def handle(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for chunk in CUT_CHUNKS[:written]:
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(0.002)  # (pacing: the verdict holds however the reads fall)
        if ending == "hold":
            await reader.read()  # until the sidecar closes the connection
        elif ending == "reset":
            reset(writer)
        return False

    return handle


async def _read_then_leave(sc: Any, session: str, until: bytes | None) -> bytes:
    """A client of ``session`` that reads the stream until ``until`` is in it, then closes its
    connection (None: it reads until the sidecar closes it); what it read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.engine.port)
    body = b'{"model":"m","stream":true}'
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\nX-Correlation-ID: %s\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (session.encode(), len(body), body)
    )
    got = b""
    async with asyncio.timeout(10):
        while until is None or until not in got:
            try:
                data = await reader.read(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                assert until is None, got  # (the sidecar never closes first while the upstream holds)
                break
            got += data
    writer.close()
    return got


@pytest.mark.parametrize(
    ("ending", "client_until"),
    [("hold", b"data: [DONE]\n\n"), ("close", None), ("reset", None)],
    ids=["client closes after [DONE]", "upstream closes after [DONE]", "upstream resets after [DONE]"],
)
async def test_a_stream_cut_after_its_usage_counts_it(ending, client_until, raw_upstream, start_sidecar):
    """The commonest end of a stream: the client stops at ``data: [DONE]`` and closes before the
    body's last chunk (aiohttp's ``async with`` left at ``[DONE]``, many SSE clients); or the
    upstream fails after its usage event. The upstream reported its usage and it was relayed:
    the turn counts it (a usage read from the last bytes relayed before the cut)."""
    up = await raw_upstream({"/v1/chat/completions": _stream_then(len(CUT_CHUNKS), ending)})
    sc = await start_sidecar(upstream=up.url, mode="dynamo_headers")
    got = await _read_then_leave(sc, "cut", client_until)
    assert b'"usage":{"prompt_tokens":726' in got and b"data: [DONE]\n\n" in got
    assert not got.endswith(b"0\r\n\r\n")  # (the body's end never went out)
    await settled(sc, "cut")
    async with aiohttp.ClientSession() as http:
        assert await counted(http, sc, "cut") == prompt_cache(*CUT_COUNTS, 1, 0)
        async with http.get(sc.admin_url + "/metrics") as resp:
            text = await resp.text()
    assert 'sidecar_usage_responses_total{deployment="default",mode="dynamo_headers",outcome="reported"} 1.0' in text


@pytest.mark.parametrize("ending", ["hold", "close"], ids=["client closes", "upstream closes"])
async def test_a_stream_cut_before_its_usage_is_not_counted(ending, raw_upstream, start_sidecar):
    """Cut before its usage event, a stream's usage is not known (it was still to come): the turn
    is neither reported nor unknown, and no outcome is counted."""
    up = await raw_upstream({"/v1/chat/completions": _stream_then(3, ending)})
    sc = await start_sidecar(upstream=up.url, mode="dynamo_headers")
    got = await _read_then_leave(sc, "early", b'"content":"w "' if ending == "hold" else None)
    assert b'"content":"w "' in got and b'"usage"' not in got
    await settled(sc, "early")
    async with aiohttp.ClientSession() as http:
        assert await counted(http, sc, "early") == prompt_cache(0, 0, 0, 0)
        async with http.get(sc.admin_url + "/metrics") as resp:
            text = await resp.text()
    assert "sidecar_usage_responses_total{" not in text
