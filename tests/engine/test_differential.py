"""Differential corpus: the same bytes through both engines must look the same on both wires.

Each case sends raw request bytes through the aiohttp engine and through the fast engine, both
in front of one raw upstream that answers ``/d`` with the case's raw reply, and compares:

* upstream-visible requests: request line, header list (names as sent, values, order), body
  bytes, framing (length / chunked / none). Nothing is normalized here: both engines put Host
  first and X-Forwarded-For / X-Forwarded-Proto / mode headers after the client's, and the
  engines share one upstream, so even Host is identical;
* client-visible responses: status line, header list minus ``Date`` and ``Server`` (the aiohttp
  engine adds its own when the upstream sends none), body bytes, framing, and whether the proxy
  closed the connection afterwards. Interim ``100 Continue`` responses are not compared (the
  aiohttp engine sends one even when the body already arrived with the head).

A case with ``known`` documents a difference between the engines instead; the test then asserts
each engine's own documented outcome (statuses, what reached the upstream), never nothing:

``octet-stream``  the aiohttp engine adds ``Content-Type: application/octet-stream`` to
                  responses whose upstream sent no Content-Type (the fast engine adds nothing).
``header-case``   aiohttp canonicalizes the case of some well-known response header names
                  (``ETag`` -> ``Etag``); the fast engine relays names byte for byte.
``refusal-body``  both engines refuse with the same status or a 4xx, never forward, and close;
                  the aiohttp engine answers malformed bytes with an HTTP/1.0 status line
                  (aiohttp's parser stopped before the version), the fast engine with HTTP/1.1.
``pipeline-error`` a malformed request pipelined behind a valid one: the fast engine answers the
                  valid one, then 400 and close; aiohttp's parser refuses the whole batch.
``chunk-bws``     whitespace RFC 9112 7.1.1 allows in chunked framing (around ``;`` and ``=`` in
                  chunk extensions, around the Transfer-Encoding value): the compiled fast engine
                  decodes such bodies itself and forwards them re-framed; llhttp (aiohttp's
                  parser, and httptools in the pure-Python build) refuses them with 400.
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from sidecar.app import Sidecar
from sidecar.config import build_config
from sidecar.engine.fast import FastEngine
from tests.engine import RawMessage, RawUpstream, WireError, closed_soon, read_response, reply


def resp(
    status: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes = b"",
    *,
    chunks: list[bytes] | None = None,
    version: bytes = b"HTTP/1.1",
) -> bytes:
    """A raw upstream response: length-framed, or chunked with these chunk payloads."""
    head = version + b" " + status + b"\r\n" + b"".join(b"%s: %s\r\n" % kv for kv in headers)
    if chunks is not None:
        body_b = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + body_b
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


JSON = (b"Content-Type", b"application/json")
GZIPPED = gzip.compress(b'{"hello": "compressed world"}' * 40)
BIG_BODY = bytes(range(256)) * 4096  # 1 MiB
BIG_REPLY = b"r" * (2 * 1024 * 1024)


@dataclass(frozen=True)
class Case:
    request: bytes
    reply: bytes | None = None  # the upstream's answer to /d (None: a JSON echo of the request)
    responses: int = 1
    head: bool = False
    mode: str | None = "dynamo_headers"
    config: dict[str, Any] = field(default_factory=dict)
    known: str = ""  # a documented difference (see the module docstring)
    # For "refusal-body", "pipeline-error", "chunk-bws": each engine's statuses and how many
    # requests reached the upstream through it.
    statuses: dict[str, list[int]] = field(default_factory=dict)
    forwarded: dict[str, int] = field(default_factory=dict)
    refused: int = 0  # for a case without a difference: the status both engines refuse it with


def get(extra: bytes = b"", target: bytes = b"/d") -> bytes:
    return b"GET " + target + b" HTTP/1.1\r\nHost: client.example\r\n" + extra + b"\r\n"


CORPUS: dict[str, Case] = {
    # -- requests -------------------------------------------------------------------------
    "session_header_becomes_dynamo_id": Case(get(b"X-Correlation-ID: s-1\r\nAccept: */*\r\n", b"/d?q=1&r=%20")),
    "spoofed_gateway_header_replaced": Case(get(b"X-Correlation-ID: s-2\r\nX-Dynamo-Session-ID: spoof\r\n")),
    "no_session_passes_gateway_header": Case(get(b"X-Dynamo-Session-ID: own\r\nX-Request-ID: r-1\r\n")),
    "post_json_with_length": Case(
        b"POST /d HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\n"
        b'Content-Length: 13\r\nX-Session-ID: s-3\r\n\r\n{"model":"m"}'
    ),
    "post_chunked_with_extension_and_trailer": Case(
        b"POST /d HTTP/1.1\r\nHost: c\r\nTransfer-Encoding: chunked\r\nContent-Type: text/plain\r\n\r\n"
        b"3;ext=1\r\nabc\r\n5\r\ndefgh\r\n0\r\nX-Trailer: t\r\n\r\n"
    ),
    "post_without_body_gets_zero_length": Case(b"POST /d HTTP/1.1\r\nHost: c\r\n\r\n"),
    "delete_without_body_gets_zero_length": Case(b"DELETE /d HTTP/1.1\r\nHost: c\r\n\r\n"),
    "hop_by_hop_request_headers_dropped": Case(
        get(
            b"Connection: keep-alive, X-Hop\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\n"
            b"Proxy-Authorization: Basic eA==\r\nUpgrade: h2c\r\nX-End: kept\r\n"
        )
    ),
    "connection_header_on_two_lines_names_both": Case(
        get(b"Connection: X-A\r\nX-A: 1\r\nConnection: x-b, keep-alive\r\nX-B: 2\r\nX-C: kept\r\n")
    ),
    # A Connection token naming a framing field (or Host) never unframes the message.
    "connection_names_content_length": Case(
        b"POST /d HTTP/1.1\r\nHost: c\r\nConnection: keep-alive, Content-Length\r\nContent-Length: 5\r\n\r\nhello"
    ),
    "connection_names_transfer_encoding": Case(
        b"POST /d HTTP/1.1\r\nHost: c\r\nConnection: TRANSFER-ENCODING\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    ),
    "connection_names_host": Case(get(b"Connection: Host, X-A\r\nX-A: 1\r\n")),
    "response_connection_names_content_length": Case(
        get(), resp(b"200 OK", [(b"Connection", b"content-length"), JSON], b'{"a":1}')
    ),
    "forwarded_for_appended_proto_kept": Case(
        get(b"X-Forwarded-For: 10.0.0.1\r\nX-Forwarded-For: 10.0.0.2\r\nX-Forwarded-Proto: https\r\n")
    ),
    "repeated_and_odd_case_request_headers": Case(
        get(b"Accept: text/html\r\nx-ODD-case: v\r\nAccept: application/json\r\nX-EMPTY:\r\n")
    ),
    "utf8_header_value": Case(get(b"X-Note: caf\xc3\xa9 \xe2\x9c\x93\r\n")),
    "large_request_body": Case(b"PUT /d HTTP/1.1\r\nHost: c\r\nContent-Length: %d\r\n\r\n" % len(BIG_BODY) + BIG_BODY),
    "http10_request_closes": Case(b"GET /d HTTP/1.0\r\nHost: c\r\n\r\n"),
    "http10_keepalive_honoured": Case(b"GET /d HTTP/1.0\r\nHost: c\r\nConnection: keep-alive\r\n\r\n"),
    "connection_close_honoured": Case(get(b"Connection: close\r\n")),
    "expect_continue_with_body": Case(
        b"POST /d HTTP/1.1\r\nHost: c\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhello"
    ),
    "pipelined_requests_in_order": Case(
        get(target=b"/d?n=1") + b"POST /d?n=2 HTTP/1.1\r\nHost: c\r\n"
        b"Content-Length: 2\r\n\r\nhi" + get(target=b"/d?n=3"),
        responses=3,
    ),
    "body_mode_rewrites_with_fresh_length": Case(
        b"POST /d HTTP/1.1\r\nHost: c\r\nX-Correlation-ID: s-4\r\nContent-Type: application/json\r\n"
        b'Transfer-Encoding: chunked\r\n\r\n6\r\n{"mode\r\n9\r\nl":"m","a\r\n3\r\n":1\r\n1\r\n}\r\n0\r\n\r\n',
        mode="dynamo_nvext",
    ),
    "body_mode_passes_invalid_json": Case(
        b"POST /d HTTP/1.1\r\nHost: c\r\nX-Correlation-ID: s-5\r\nContent-Length: 5\r\n\r\nnope!", mode="dynamo_nvext"
    ),
    # -- response shapes --------------------------------------------------------------------
    "fixed_length_response": Case(get(), resp(b"200 OK", [JSON, (b"X-Up", b"1")], b'{"a":1}')),
    "chunked_response": Case(get(), resp(b"200 OK", [JSON], chunks=[b'{"a"', b":", b"1}"])),
    "sse_response": Case(
        get(b"Accept: text/event-stream\r\n"),
        resp(
            b"200 OK",
            [(b"Content-Type", b"text/event-stream"), (b"Cache-Control", b"no-cache")],
            chunks=[b'data: {"i":0}\n\n', b'data: {"i":1}\n\n', b"data: [DONE]\n\n"],
        ),
    ),
    "empty_204": Case(b"DELETE /d HTTP/1.1\r\nHost: c\r\n\r\n", b"HTTP/1.1 204 No Content\r\nX-Up: 1\r\n\r\n"),
    "not_modified_304": Case(
        get(b'If-None-Match: "v1"\r\n'),
        b'HTTP/1.1 304 Not Modified\r\nETag: "v1"\r\nCache-Control: max-age=5\r\n\r\n',
        known="header-case",
    ),
    "head_response_without_body": Case(
        b"HEAD /d HTTP/1.1\r\nHost: c\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 99\r\n\r\n",
        head=True,
    ),
    "gzip_body_untouched": Case(
        get(b"Accept-Encoding: gzip\r\n"),
        resp(b"200 OK", [JSON, (b"Content-Encoding", b"gzip"), (b"Vary", b"Accept-Encoding")], GZIPPED),
    ),
    "multiple_set_cookie": Case(
        get(),
        resp(b"200 OK", [(b"Set-Cookie", b"a=1; Path=/; HttpOnly"), (b"Set-Cookie", b"b=2; Max-Age=60"), JSON], b"{}"),
    ),
    "odd_header_case_response": Case(
        get(), resp(b"200 OK", [(b"x-ODD-Case", b"v"), (b"X-lower-case", b"w"), JSON], b"{}")
    ),
    "well_known_header_in_odd_case": Case(
        get(), resp(b"200 OK", [(b"content-TYPE", b"text/plain")], b"odd"), known="header-case"
    ),
    "hop_by_hop_response_headers_dropped": Case(
        get(),
        resp(
            b"200 OK",
            [
                (b"Connection", b"X-Private, keep-alive"),
                (b"X-Private", b"secret"),
                (b"Keep-Alive", b"timeout=5"),
                (b"Proxy-Authenticate", b"Basic"),
                (b"X-End-To-End", b"kept"),
                JSON,
            ],
            b"{}",
        ),
    ),
    "response_header_spacing_and_case": Case(
        get(),
        b"HTTP/1.1 200 OK\r\nx-tight:v\r\nX-Spaced: \t v w \t\r\n"
        b"X-Empty:\r\nCONNECTION: Keep-Alive\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok",
    ),
    "many_response_headers_with_connection_names": Case(
        get(),
        resp(
            b"200 OK",
            [
                *[(b"X-H%d" % i, b"v%d" % i) for i in range(40)],
                (b"Connection", b"x-h3"),
                (b"Connection", b"X-H7, close"),
                (b"Trailer", b"X-T"),
                (b"Upgrade", b"h2c"),
                JSON,
            ],
            b"{}",
        ),
    ),
    "large_response": Case(get(), resp(b"200 OK", [(b"Content-Type", b"application/octet-stream")], BIG_REPLY)),
    "eof_delimited_response": Case(
        get(), b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the upstream closes"
    ),
    "upstream_error_status_relayed": Case(
        get(), resp(b"503 Service Unavailable", [JSON, (b"Retry-After", b"1")], b'{"error":"busy"}')
    ),
    "no_content_type_response": Case(get(), b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", known="octet-stream"),
    # -- answered by the sidecar --------------------------------------------------------------
    "declared_body_over_limit_413": Case(
        b"POST /d HTTP/1.1\r\nHost: c\r\nContent-Length: 101\r\n\r\n" + b"x" * 101,
        config={"limits": {"max_body_bytes": 100}},
    ),
    "upgrade_refused_501": Case(get(b"Upgrade: websocket\r\nConnection: Upgrade\r\n")),
    "absolute_form_target_in_origin_form": Case(get(target=b"http://other.example/d?q=1")),
    # -- malformed: both refuse, in their own format ------------------------------------------
    "content_length_and_chunked": Case(
        b"POST /d HTTP/1.1\r\nHost: c\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        known="refusal-body",
        statuses={"aiohttp": [400], "fast": [400]},
        forwarded={"aiohttp": 0, "fast": 0},
    ),
    "duplicate_content_length": Case(
        b"POST /d HTTP/1.1\r\nHost: c\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
        known="refusal-body",
        statuses={"aiohttp": [400], "fast": [400]},
        forwarded={"aiohttp": 0, "fast": 0},
    ),
    "bad_chunk_size": Case(
        b"POST /d HTTP/1.1\r\nHost: c\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
        known="refusal-body",
        statuses={"aiohttp": [400], "fast": [400]},
        forwarded={"aiohttp": 0, "fast": 0},
    ),
    "obs_fold_header": Case(
        get(b"X-Folded: a\r\n b\r\n"),
        known="refusal-body",
        statuses={"aiohttp": [400], "fast": [400]},
        forwarded={"aiohttp": 0, "fast": 0},
    ),
    "head_over_header_limit": Case(
        get(b"X-Big: " + b"a" * 3000 + b"\r\n"),
        config={"limits": {"max_header_bytes": 2048}},
        known="refusal-body",
        statuses={"aiohttp": [431], "fast": [431]},
        forwarded={"aiohttp": 0, "fast": 0},
    ),
    "pipelined_smuggling_attempt": Case(
        get() + b"POST /d HTTP/1.1\r\nHost: c\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: c\r\n\r\n",
        responses=2,
        known="pipeline-error",
        statuses={"aiohttp": [400], "fast": [200, 400]},
        forwarded={"aiohttp": 0, "fast": 1},
    ),
    "chunk_extension_whitespace": Case(
        b"POST /d HTTP/1.1\r\nHost: c\r\nTransfer-Encoding: chunked\r\n\r\n3 ; ext = 1\r\nabc\r\n0\r\n\r\n",
        known="chunk-bws",
        statuses={"aiohttp": [400], "fast": [200]},
        forwarded={"aiohttp": 0, "fast": 1},
    ),
    "transfer_encoding_value_with_tabs": Case(
        b"POST /d HTTP/1.1\r\nHost: c\r\nTransfer-Encoding:\tchunked\t\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        known="chunk-bws",
        statuses={"aiohttp": [400], "fast": [200]},
        forwarded={"aiohttp": 0, "fast": 1},
    ),
    # Refused alike: a coding before chunked would reach the upstream unlabelled once the chunked
    # framing is undone, and chunked on HTTP/1.0 is faulty framing (RFC 9112 6.1).
    "transfer_coding_before_chunked": Case(
        b"POST /d HTTP/1.1\r\nHost: c\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        refused=400,
    ),
    "identity_before_chunked": Case(
        b"POST /d HTTP/1.1\r\nHost: c\r\nTransfer-Encoding: identity, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        refused=400,
    ),
    "chunked_on_http10": Case(
        b"POST /d HTTP/1.0\r\nHost: c\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        refused=400,
    ),
    # A request line without an HTTP version is HTTP/0.9: refused as soon as the line ends,
    # whether header lines follow or not (an HTTP/0.9 client sends none), as is version 0.9.
    "request_line_without_version": Case(b"GET /d\r\n", refused=400),
    "request_line_without_version_then_a_head": Case(b"GET /d\r\nHost: c\r\n\r\n", refused=400),
    "http09_version": Case(b"GET /d HTTP/0.9\r\nHost: c\r\n\r\n", refused=400),
    "http2_version_on_http1": Case(
        b"GET /d HTTP/2.0\r\nHost: c\r\n\r\n",
        known="refusal-body",
        statuses={"aiohttp": [400], "fast": [400]},
        forwarded={"aiohttp": 0, "fast": 0},
    ),
}


async def echo(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    body = orjson.dumps({"target": req.target, "bytes": len(req.body)})
    writer.write(resp(b"200 OK", [JSON], body))
    await writer.drain()
    return True


def handler_for(case: Case) -> Any:
    if case.reply is None:
        return echo
    keep = not case.reply.startswith(b"HTTP/1.0")  # an EOF-delimited reply ends with the connection
    return reply(case.reply, keep=keep)


@dataclass
class Seen:
    forwarded: list[tuple[str, list[tuple[str, str]], bytes, str]]
    responses: list[tuple[str, list[tuple[str, str]], bytes, str]]
    closed: bool


@pytest.fixture
async def pair() -> AsyncIterator[Any]:
    """Start an upstream and both engines in front of it, for one case."""
    started: list[Any] = []

    async def start(case: Case) -> tuple[RawUpstream, dict[str, Sidecar]]:
        up = await RawUpstream({"/d": handler_for(case)}).start()
        started.append(up)
        sidecars = {}
        for engine in ("aiohttp", "fast"):
            flags = {
                "listen": "127.0.0.1:0",
                "admin": "127.0.0.1:0",
                "upstream": up.url,
                "mode": case.mode,
                "engine": engine,
            }
            cfg = _config(flags, case.config)
            sc = Sidecar(cfg, registry=CollectorRegistry())
            await sc.start()
            started.append(sc)
            sidecars[engine] = sc
        return up, sidecars

    yield start
    for item in reversed(started):
        await item.stop()


def _config(flags: dict[str, Any], keys: dict[str, Any]) -> Any:
    """Flags plus config-file keys (``limits`` apply to the deployment, as in production)."""
    import tempfile

    import yaml

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump({**keys, "readiness_check_upstream": False}, f)
    return build_config(flags=flags, env={}, file=f.name)


async def through(sc: Sidecar, up: RawUpstream, case: Case) -> Seen:
    before = len(up.received)
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.engine.port)
    responses = []
    closed = False
    try:
        writer.write(case.request)
        await writer.drain()
        async with asyncio.timeout(10):
            for _ in range(case.responses):
                try:
                    r = await read_response(reader, head=case.head)
                except (WireError, ConnectionResetError, asyncio.IncompleteReadError):
                    closed = True
                    break
                responses.append(
                    (r.start, [(k, v) for k, v in r.headers if k not in ("Date", "Server")], r.body, r.framing)
                )
                if r.framing == "close":
                    closed = True
                    break
        if not closed:
            try:
                closed = await closed_soon(reader, 0.5)
            except WireError:
                closed = False
    finally:
        writer.close()
    await asyncio.sleep(0.05)
    forwarded = [(r.start, r.headers, r.body, r.framing) for r in up.received[before:]]
    return Seen(forwarded, responses, closed)


def normalized(seen: Seen, engine: str, known: str) -> Seen:
    responses = seen.responses
    if known == "octet-stream" and engine == "aiohttp":
        responses = [
            (s, [(k, v) for k, v in hs if (k, v) != ("Content-Type", "application/octet-stream")], b, f)
            for s, hs, b, f in responses
        ]
    if known == "header-case":
        responses = [(s, [(k.lower(), v) for k, v in hs], b, f) for s, hs, b, f in responses]
    return Seen(seen.forwarded, responses, seen.closed)


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 25
    assert {c.known for c in CORPUS.values()} <= {
        "",
        "octet-stream",
        "header-case",
        "refusal-body",
        "pipeline-error",
        "chunk-bws",
    }


@pytest.mark.parametrize("name", sorted(CORPUS))
async def test_engines_agree_on_the_wire(name: str, pair) -> None:
    case = CORPUS[name]
    up, sidecars = await pair(case)
    seen = {engine: await through(sc, up, case) for engine, sc in sidecars.items()}
    if case.known in ("refusal-body", "pipeline-error", "chunk-bws"):
        for engine, s in seen.items():
            statuses, forwarded = case.statuses[engine], case.forwarded[engine]
            if case.known == "chunk-bws" and engine == "fast" and not FastEngine.compiled:
                statuses, forwarded = [400], 0  # httptools' llhttp refuses, like aiohttp's
            assert [int(r[0].split(" ")[1]) for r in s.responses] == statuses, (engine, s.responses)
            assert len(s.forwarded) == forwarded, (engine, s.forwarded)
            if case.known == "chunk-bws" and forwarded:
                assert [(f[2], f[3]) for f in s.forwarded] == [(b"abc", "chunked")]
            assert all(b"/smuggled" not in f[0].encode() for f in s.forwarded)
        fast = seen["fast"]
        if fast.responses and int(fast.responses[-1][0].split(" ")[1]) >= 400:
            status = int(fast.responses[-1][0].split(" ")[1])
            err = orjson.loads(fast.responses[-1][2])["error"]
            assert err["type"] == {431: "headers_too_large", 501: "upgrade_not_supported"}.get(status, "bad_request")
            assert fast.closed
        if case.known == "refusal-body":
            assert seen["aiohttp"].closed
        return
    a = normalized(seen["aiohttp"], "aiohttp", case.known)
    f = normalized(seen["fast"], "fast", case.known)
    assert f.forwarded == a.forwarded
    assert f.responses == a.responses
    assert f.closed == a.closed
    assert len(f.responses) == case.responses
    if case.refused:
        assert [int(r[0].split(" ")[1]) for r in f.responses] == [case.refused], f.responses
        assert orjson.loads(f.responses[0][2])["error"]["type"] == "bad_request"
        assert f.forwarded == [] and f.closed
