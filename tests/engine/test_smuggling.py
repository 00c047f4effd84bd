"""Request smuggling through header filters, on both engines, in both directions.

A ``Connection`` header may name the hop-by-hop fields a proxy must not forward. When it names a
field that frames the message (``Content-Length``, ``Transfer-Encoding``) or ``Host``, the proxy
still frames the message from what its parser found: the request is forwarded with its body
intact and correctly framed, and a response is relayed with its own framing. A single client
cannot see a desync, so every test here puts two clients on one pooled upstream connection
(``max_connections_per_upstream: 1``): each client's request and response must be exactly its own.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from tests.engine import RawMessage, echo, read_response, reply

SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: x\r\nX-Correlation-ID: attacker\r\n\r\n"
ONE_CONNECTION = {"limits": {"max_connections_per_upstream": 1}, "readiness_check_upstream": False}


def _length_framed(connection: bytes) -> bytes:
    return (
        b"POST /attack HTTP/1.1\r\nHost: x\r\nConnection: " + connection + b"\r\n"
        b"Content-Length: %d\r\n\r\n" % len(SMUGGLED) + SMUGGLED
    )


def _chunked(connection: bytes) -> bytes:
    return (
        b"POST /attack HTTP/1.1\r\nHost: x\r\nConnection: " + connection + b"\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(SMUGGLED) + SMUGGLED + b"\r\n0\r\n\r\n"
    )


NOMINATIONS = {
    "content_length": _length_framed(b"content-length"),
    "content_length_upper_with_keepalive": _length_framed(b"keep-alive, CONTENT-LENGTH"),
    "content_length_first_of_two": _length_framed(b"Content-Length, X-Other"),
    "host_and_content_length": _length_framed(b"Host, Content-Length"),
    "transfer_encoding": _chunked(b"keep-alive, Transfer-Encoding"),
    "transfer_encoding_mixed_case": _chunked(b"TRANSFER-encoding"),
}


async def _ask(port: int, data: bytes) -> tuple[RawMessage, asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    async with asyncio.timeout(5):
        return await read_response(reader), reader, writer


@pytest.mark.parametrize("case", sorted(NOMINATIONS))
async def test_connection_naming_framing_never_unframes_a_request(case, raw_upstream, start_sidecar):
    up = await raw_upstream({"/attack": echo(), "/victim": echo(), "/smuggled": echo()})
    sc = await start_sidecar(upstream=up.url, mode="dynamo_headers", **ONE_CONNECTION)
    attack, _, w1 = await _ask(sc.engine.port, NOMINATIONS[case])
    victim, _, w2 = await _ask(sc.engine.port, b"GET /victim HTTP/1.1\r\nHost: x\r\nX-Correlation-ID: victim\r\n\r\n")
    w1.close()
    w2.close()
    # Each client got the answer to its own request.
    assert orjson.loads(attack.body) == {"target": "/attack", "bytes": len(SMUGGLED)}
    assert orjson.loads(victim.body) == {"target": "/victim", "bytes": 0}
    # The upstream saw exactly the two requests, on one connection, the body intact and framed.
    assert [(r.target, r.conn) for r in up.received] == [("/attack", 1), ("/victim", 1)]
    forwarded = up.received[0]
    assert forwarded.body == SMUGGLED
    if case.startswith("transfer_encoding"):
        assert forwarded.framing == "chunked" and forwarded.header("Content-Length") is None
    else:
        assert forwarded.framing == "length" and forwarded.all("Content-Length") == [str(len(SMUGGLED))]
    assert forwarded.all("Host") == [f"127.0.0.1:{up.port}"]
    assert up.received[1].header("X-Dynamo-Session-ID") == "victim"


@pytest.mark.parametrize("nominated", [b"content-length", b"Keep-Alive, Content-Length", b"CONTENT-LENGTH, close"])
async def test_connection_naming_framing_never_unframes_a_response(nominated, raw_upstream, start_sidecar):
    # The upstream's first answer names its own Content-Length as hop-by-hop and carries a body
    # that looks like a second response: relayed unframed, it would answer the next request.
    fake = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled"
    first = (
        b"HTTP/1.1 200 OK\r\nConnection: " + nominated + b"\r\nContent-Type: text/plain\r\n"
        b"Content-Length: %d\r\n\r\n" % len(fake) + fake
    )
    keep = b"close" not in nominated.lower()
    up = await raw_upstream({"/first": reply(first, keep=keep), "/next": echo(), "/other": echo()})
    sc = await start_sidecar(upstream=up.url, **ONE_CONNECTION)
    resp, reader, writer = await _ask(sc.engine.port, b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
    assert resp.framing == "length"
    assert resp.all("Content-Length") == [str(len(fake))]
    assert resp.body == fake
    # The same client connection, then a second client: each gets its own answer.
    writer.write(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
    async with asyncio.timeout(5):
        nxt = await read_response(reader)
    assert orjson.loads(nxt.body) == {"target": "/next", "bytes": 0}
    other, _, w2 = await _ask(sc.engine.port, b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n")
    assert orjson.loads(other.body) == {"target": "/other", "bytes": 0}
    writer.close()
    w2.close()
    assert [r.target for r in up.received] == ["/first", "/next", "/other"]


async def test_connection_naming_transfer_encoding_of_a_chunked_response_keeps_it_framed(raw_upstream, start_sidecar):
    first = (
        b"HTTP/1.1 200 OK\r\nConnection: Transfer-Encoding\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    up = await raw_upstream({"/first": reply(first), "/next": echo()})
    sc = await start_sidecar(upstream=up.url, **ONE_CONNECTION)
    resp, reader, writer = await _ask(sc.engine.port, b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
    assert resp.framing == "chunked" and resp.body == b"hello world"
    writer.write(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
    async with asyncio.timeout(5):
        nxt = await read_response(reader)
    writer.close()
    assert orjson.loads(nxt.body) == {"target": "/next", "bytes": 0}
