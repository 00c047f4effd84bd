"""The fast engine's two sets of parsers (sidecar.engine.parsers) against each other.

The compiled build parses with the vendored llhttp driven from C (``LlhttpParser``,
``LlhttpResponseParser``), the pure-Python build with httptools (``HttptoolsParser``,
``HttptoolsResponseParser``). Both must hand the engine the same requests and responses for the
same bytes however the bytes are split into reads, and fail the same way; the compiled request
parser must hand over the header lines exactly as they arrived. The compiled response parser
reads the plainest heads without llhttp: on generated heads, it must read exactly as llhttp does.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.engine.parsers import (
    CallbackError,
    HeadTooLarge,
    HttptoolsParser,
    HttptoolsResponseParser,
    ParseError,
    RequestParser,
    UpgradeRequest,
)

try:
    from sidecar.engine.llhttp_parser import LlhttpParser, LlhttpResponseParser, plain_head
except ImportError:  # the pure-Python build (or SIDECAR_PURE_PYTHON=1)
    LlhttpParser = LlhttpResponseParser = plain_head = None

COMPILED_ONLY = pytest.mark.skipif(LlhttpParser is None, reason="the llhttp parsers are compiled only")
PARSERS = [HttptoolsParser] + ([LlhttpParser] if LlhttpParser is not None else [])
RESPONSE_PARSERS = [HttptoolsResponseParser] + ([LlhttpResponseParser] if LlhttpResponseParser is not None else [])
LIMIT = 2048


def fields(raw: bytes, first: int, end: int) -> list[tuple[bytes, bytes]]:
    """The (name, value) pairs of a header block, values without the leading OWS llhttp skips."""
    return [
        (name, value.lstrip(b" \t"))
        for name, _, value in (line.partition(b":") for line in raw[first:end].split(b"\r\n")[:-1])
    ]


class Recorder:
    """An owner that records what the parser hands it."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.blocks: list[bytes] = []

    def on_head(
        self,
        raw: bytes,
        first: int,
        end: int,
        method: bytes,
        target: bytes,
        version: int,
        keep_alive: bool,
        length: int,
    ) -> None:
        self.events.append(("head", method, target, version, keep_alive, length, fields(raw, first, end)))
        self.blocks.append(raw[first:end])

    def on_body(self, data: bytes) -> None:
        if self.events and self.events[-1][0] == "body":  # reads split bodies anywhere: merge
            self.events[-1] = ("body", self.events[-1][1] + data)
        else:
            self.events.append(("body", data))

    def on_message_complete(self) -> None:
        self.events.append(("end",))


def run(parser_class: Any, reads: list[bytes], limit: int = LIMIT) -> tuple[Recorder, str | None]:
    """Feed ``reads`` until one raises; the recorder and the exception's class name (or None)."""
    owner = Recorder()
    parser = parser_class(owner, limit)
    for data in reads:
        try:
            parser.feed_data(data)
        except (ParseError, UpgradeRequest) as exc:
            return owner, type(exc).__name__
    return owner, None


def heads_of(owner: Recorder) -> list[tuple[Any, ...]]:
    return [e for e in owner.events if e[0] == "head"]


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:]) if b > a]


def head(target: bytes = b"/", extra: bytes = b"", method: bytes = b"GET") -> bytes:
    return method + b" " + target + b" HTTP/1.1\r\nHost: h\r\n" + extra + b"\r\n"


CORPUS: dict[str, bytes] = {
    "get": head(b"/v1/models?x=1"),
    "post_with_length": head(b"/p", b"Content-Type: application/json\r\nContent-Length: 7\r\n", b"POST") + b'{"a":1}',
    "pipelined": head(b"/1") + head(b"/2", b"Content-Length: 2\r\n", b"POST") + b"hi" + head(b"/3"),
    "chunked_with_trailers": head(b"/c", b"Transfer-Encoding: chunked\r\n", b"POST")
    + b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    + head(b"/after"),
    "spacing_and_empty_values": head(b"/s", b"X-Pad:   a b  \r\nX-Empty:\r\nX-Tab:\tv\r\nx-lower: l\r\n"),
    "repeated_headers": head(b"/r", b"X-Forwarded-For: 1.1.1.1\r\nX-Forwarded-For: 2.2.2.2\r\nAccept: a\r\n"),
    "obs_text_value": head(b"/o", "X-Name: caf\u00e9\r\n".encode()),
    "http10_keepalive": b"GET /old HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /old2 HTTP/1.0\r\n\r\n",
    "connection_close": head(b"/close", b"Connection: close\r\n"),
    "expect_continue": head(b"/e", b"Expect: 100-continue\r\nContent-Length: 3\r\n", b"PUT") + b"abc",
    "big_length": head(b"/big", b"Content-Length: 1000000000000000\r\n", b"POST") + b"partial",
    "leading_crlf": b"\r\n" + head(b"/lead"),
    "long_target": head(b"/" + b"t" * 1500),
    "many_headers": head(b"/m", b"".join(b"X-H%d: %d\r\n" % (i, i) for i in range(60))),
    # refused by llhttp (strict)
    "length_and_chunked": head(b"/x", b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n", b"POST") + b"abc",
    "double_length": head(b"/x", b"Content-Length: 3\r\nContent-Length: 4\r\n", b"POST") + b"abcd",
    "space_before_colon": head(b"/x", b"X-Bad : v\r\n"),
    "bare_lf": b"GET /x HTTP/1.1\nHost: h\n\n",
    "bad_chunk_size": head(b"/x", b"Transfer-Encoding: chunked\r\n", b"POST") + b"zz\r\nhello\r\n0\r\n\r\n",
    "length_overflow": head(b"/x", b"Content-Length: 99999999999999999999\r\n", b"POST"),
    "control_char_in_value": head(b"/x", b"X-C: a\x01b\r\n"),
    "unknown_version": b"GET /x HTTP/3.7\r\nHost: h\r\n\r\n",
    # HTTP/0.9: refused as soon as the request line ended (its client sends no header lines)
    "http09_line": head(b"/1") + b"GET /x\r\n",
    "http09_line_lf": b"GET /x\n",
    "http09_line_then_a_head": b"GET /x\r\nHost: h\r\n\r\n",
    "http09_version": b"GET /x HTTP/0.9\r\nHost: h\r\n\r\n",
    "http09_version_head_in_progress": b"GET /x HTTP/0.9\r\nHost: h\r\n",
    # protocol switches: the head is handed over, then parsing stops
    "upgrade": head(b"/ws", b"Upgrade: websocket\r\nConnection: Upgrade\r\n") + head(b"/never"),
    "connect": b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n" + head(b"/never"),
    # limits (well over, so both parsers' accounting agrees)
    "oversized_header": head(b"/big", b"X-Big: " + b"a" * 3000 + b"\r\n"),
    "oversized_trailers": head(b"/t", b"Transfer-Encoding: chunked\r\n", b"POST")
    + b"1\r\na\r\n0\r\nX-T: "
    + b"b" * 3000
    + b"\r\n\r\n",
}


@pytest.mark.parametrize("parser_class", PARSERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", sorted(CORPUS))
def test_every_split_into_reads_gives_the_same_requests(name: str, parser_class: Any) -> None:
    data = CORPUS[name]
    whole, error = run(parser_class, [data])
    bytewise, bytewise_error = run(parser_class, [data[i : i + 1] for i in range(len(data))])
    assert bytewise.events == whole.events
    assert bytewise_error == error


@COMPILED_ONLY
@pytest.mark.parametrize("name", sorted(CORPUS))
def test_both_parsers_hand_over_the_same_requests(name: str) -> None:
    c, c_error = run(LlhttpParser, [CORPUS[name]])
    py, py_error = run(HttptoolsParser, [CORPUS[name]])
    assert c.events == py.events
    assert c_error == py_error


def test_corpus_outcomes() -> None:
    """The corpus exercises what it claims (so the comparisons above compare something)."""
    outcomes = {name: run(RequestParser, [data]) for name, data in CORPUS.items()}
    errors = {name: error for name, (_, error) in outcomes.items()}
    assert errors["oversized_header"] == errors["oversized_trailers"] == "HeadTooLarge"
    assert errors["upgrade"] == errors["connect"] == "UpgradeRequest"
    for name in CORPUS:
        assert (errors[name] == "Http09Request") == name.startswith("http09"), name
    assert [h[2] for h in heads_of(outcomes["http09_line"][0])] == [b"/1"]  # the request before it is handed over
    for name in (
        "length_and_chunked",
        "double_length",
        "space_before_colon",
        "bare_lf",
        "bad_chunk_size",
        "length_overflow",
        "control_char_in_value",
        "unknown_version",
    ):
        assert errors[name] == "ParseError", name
    heads = {name: [e for e in rec.events if e[0] == "head"] for name, (rec, _) in outcomes.items()}
    assert [h[2] for h in heads["pipelined"]] == [b"/1", b"/2", b"/3"]
    assert [h[2] for h in heads["upgrade"]] == [b"/ws"]  # nothing after the switch is parsed
    assert heads["post_with_length"][0][1:6] == (b"POST", b"/p", 11, True, 7)
    assert heads["big_length"][0][5] == 10**15
    assert heads["http10_keepalive"][0][3:5] == (10, True) and heads["http10_keepalive"][1][3:5] == (10, False)
    assert heads["connection_close"][0][4] is False
    assert heads["spacing_and_empty_values"][0][6] == [
        (b"Host", b"h"),
        (b"X-Pad", b"a b  "),
        (b"X-Empty", b""),
        (b"X-Tab", b"v"),
        (b"x-lower", b"l"),
    ]
    rec, _ = outcomes["chunked_with_trailers"]
    assert [e[0] for e in rec.events] == ["head", "body", "end", "head", "end"]
    assert rec.events[1] == ("body", b"hello world")


@COMPILED_ONLY
def test_compiled_parser_hands_over_header_lines_as_they_arrived() -> None:
    data = CORPUS["spacing_and_empty_values"]
    block = data[data.index(b"\r\n") + 2 : data.index(b"\r\n\r\n") + 2]
    for reads in ([data], [data[i : i + 1] for i in range(len(data))], [data[:20], data[20:41], data[41:]]):
        owner, error = run(LlhttpParser, reads)
        assert error is None
        assert owner.blocks == [block]


@pytest.mark.parametrize("parser_class", PARSERS, ids=lambda c: c.__name__)
def test_a_header_line_that_never_ends_is_refused_within_the_limit(parser_class: Any) -> None:
    parser = parser_class(Recorder(), LIMIT)
    parser.feed_data(b"GET /x HTTP/1.1\r\nX-Endless: ")
    fed = 0
    with pytest.raises(HeadTooLarge):
        while fed <= 4 * LIMIT:
            parser.feed_data(b"a" * 256)
            fed += 256
    assert fed <= LIMIT + 256  # refused within one read of the limit: the parser holds no more


@pytest.mark.parametrize("parser_class", PARSERS, ids=lambda c: c.__name__)
def test_an_exception_in_an_owner_callback_is_a_callback_error_caused_by_it(parser_class: Any) -> None:
    class Failing(Recorder):
        def on_head(self, *args: Any) -> None:
            raise RuntimeError("owner bug")

    parser = parser_class(Failing(), LIMIT)
    with pytest.raises(CallbackError) as info:
        parser.feed_data(CORPUS["get"])
    assert isinstance(info.value.__cause__, RuntimeError)


STREAM = b"".join(
    CORPUS[n]
    for n in ("post_with_length", "chunked_with_trailers", "spacing_and_empty_values", "repeated_headers", "get")
)


@settings(max_examples=150, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_random_reads_of_a_pipelined_stream_give_the_same_requests(cuts: list[int]) -> None:
    expected, expected_error = run(HttptoolsParser, [STREAM])
    assert expected_error is None and len([e for e in expected.events if e[0] == "end"]) == 6
    for parser_class in PARSERS:
        got, error = run(parser_class, split(STREAM, cuts))
        assert (got.events, error) == (expected.events, None), parser_class.__name__


def run_heads(parser_class: Any, data: bytes, split: bool = False) -> tuple[list[tuple[int, bool, int]], str | None]:
    """Feed a response stream as the engine does: spans of the bytes read, up to each head's
    empty line (in one span, or byte by byte with ``split``); the (status, keep_alive, length) of
    each head completed, and the error."""
    parser = parser_class()
    heads: list[tuple[int, bool, int]] = []
    at = 0
    while (k := data.find(b"\r\n\r\n", at)) >= 0:
        spans = [(i, i + 1) for i in range(at, k + 4)] if split else [(at, k + 4)]
        at = k + 4
        try:
            for start, stop in spans:
                status = parser.feed_head(data, start, stop)
                if status:
                    heads.append((status, parser.keep_alive, parser.length))
        except ParseError as exc:
            return heads, type(exc).__name__
    return heads, None


# Response streams as the engine feeds them (heads only) and what each must give.
RESPONSES: dict[str, tuple[bytes, tuple[list[tuple[int, bool, int]], str | None]]] = {
    "length": (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\n\r\n", ([(200, True, 5)], None)),
    "chunked": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", ([(200, True, -1)], None)),
    "close": (b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", ([(503, False, 0)], None)),
    "empty_body": (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", ([(200, True, 0)], None)),
    # Bodiless by status: Connection: close still holds (llhttp forgets it once the message completes).
    "no_content_close": (b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n", ([(204, False, -1)], None)),
    "not_modified_close": (b"HTTP/1.1 304 Not Modified\r\nConnection: close\r\n\r\n", ([(304, False, -1)], None)),
    "interim_then_final": (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
        ([(100, True, -1), (204, True, -1)], None),
    ),
    "keep_alive_responses": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nHTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n",
        ([(200, True, 9), (404, True, -1)], None),
    ),
    "interim_then_length": (
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n",
        ([(103, True, -1), (200, True, 7)], None),
    ),
    "until_eof": (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n", ([(200, False, -1)], None)),
    "http10": (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n", ([(200, False, 2)], None)),
    "http10_keep_alive": (
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\n",
        ([(200, True, 2)], None),
    ),
    "bad_status_line": (b"HTTP/1.1 2000 OK\r\n\r\n", ([], "ParseError")),
    "length_and_chunked": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        ([], "ParseError"),
    ),
    "switching_protocols": (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        ([], "ParseError"),
    ),
}


@pytest.mark.parametrize("parser_class", RESPONSE_PARSERS, ids=lambda c: c.__name__)
def test_response_parser_refuses_a_span_outside_the_data(parser_class: Any) -> None:
    data = b"HTTP/1.1 200 OK\r\n\r\n"
    for start, stop in [(-1, 4), (5, 4), (0, len(data) + 1)]:
        with pytest.raises(ValueError, match="outside the data"):
            parser_class().feed_head(data, start, stop)
    assert parser_class().feed_head(data, 0, len(data)) == 200


@pytest.mark.parametrize("parser_class", RESPONSE_PARSERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", sorted(RESPONSES))
def test_response_heads_give_status_and_keep_alive_however_split(name: str, parser_class: Any) -> None:
    data, expected = RESPONSES[name]
    assert run_heads(parser_class, data) == expected
    assert run_heads(parser_class, data, split=True) == expected


# RFC 9112 7.1.1 allows bad whitespace (BWS) around ";" and "=" in chunk extensions, and OWS around
# a Transfer-Encoding value; llhttp refuses both, so the compiled parser decodes request bodies
# with a Transfer-Encoding itself. httptools (the pure-Python build) still refuses them.
BWS_CHUNKED: dict[str, tuple[bytes, bytes]] = {
    "space_before_semicolon": (b"Transfer-Encoding: chunked\r\n", b"3 ;ext=1\r\nabc\r\n0\r\n\r\n"),
    "spaces_around_equals": (b"Transfer-Encoding: chunked\r\n", b"3 ; ext = 1\r\nabc\r\n0\r\n\r\n"),
    "tabs_and_quoted_value": (b"Transfer-Encoding: chunked\r\n", b'3\t;\tx\t=\t"a \\" b"\r\nabc\r\n0 ; last\r\n\r\n'),
    "several_extensions": (b"Transfer-Encoding: chunked\r\n", b'3;a;b=c ; d="e"\r\nabc\r\n2\r\nde\r\n0\r\n\r\n'),
    "spaces_after_size": (b"Transfer-Encoding: chunked\r\n", b"3  \r\nabc\r\n0\r\n\r\n"),
    "te_value_with_tabs": (b"Transfer-Encoding:\tchunked\t\r\n", b"3\r\nabc\r\n0\r\n\r\n"),
    "te_value_with_spaces": (b"Transfer-Encoding:  chunked  \r\n", b"3\r\nabc\r\n0\r\nX-T: v\r\n\r\n"),
    "leading_zeros_and_upper_hex": (b"Transfer-Encoding: chunked\r\n", b"000A\r\n0123456789\r\n0\r\n\r\n"),
}
BAD_CHUNKED: dict[str, bytes] = {
    "control_char_in_extension": b"3;x=\x01\r\nabc\r\n0\r\n\r\n",
    "unterminated_quoted_value": b'3;x="abc\r\nabc\r\n0\r\n\r\n',
    "no_crlf_after_data": b"3\r\nabcX\r\n0\r\n\r\n",
    "bare_lf_after_size": b"3\nabc\r\n0\r\n\r\n",
    "size_too_large": b"1000000000000000\r\na\r\n0\r\n\r\n",
    "no_size": b";ext\r\nabc\r\n0\r\n\r\n",
    "bad_trailer": b"3\r\nabc\r\n0\r\nBad Trailer: x\r\n\r\n",
    "oversized_size_line": b"3;" + b"a" * 5000 + b"\r\nabc\r\n0\r\n\r\n",
}


@COMPILED_ONLY
@pytest.mark.parametrize("name", sorted(BWS_CHUNKED))
def test_compiled_parser_accepts_whitespace_rfc9112_allows_in_chunked_framing(name: str) -> None:
    framing, body = BWS_CHUNKED[name]
    data = head(b"/c", framing, b"POST") + body + head(b"/after")
    whole, error = run(LlhttpParser, [data])
    bytewise, bytewise_error = run(LlhttpParser, [data[i : i + 1] for i in range(len(data))])
    assert error is None and bytewise_error is None
    assert bytewise.events == whole.events
    decoded = b"0123456789" if name.startswith("leading") else b"abcde" if name == "several_extensions" else b"abc"
    assert [e[0] for e in whole.events] == ["head", "body", "end", "head", "end"]
    assert whole.events[1] == ("body", decoded)
    assert whole.events[3][2] == b"/after"


@COMPILED_ONLY
@pytest.mark.parametrize("name", sorted(BAD_CHUNKED))
def test_compiled_parser_refuses_malformed_chunked_framing(name: str) -> None:
    data = head(b"/c", b"Transfer-Encoding: chunked\r\n", b"POST") + BAD_CHUNKED[name] + head(b"/never")
    for reads in ([data], [data[i : i + 1] for i in range(len(data))]):
        owner, error = run(LlhttpParser, reads)
        assert error == "ParseError", reads
        assert ("end",) not in owner.events  # the request never completes


# The compiled response parser's own reading of the plainest heads (llhttp_parser._plain_head)
# against llhttp's. Heads are generated from pieces that sit on both sides of every rule of that
# form (version, status, reason bytes, token names, the names llhttp gives meaning, their values,
# line ends), then optionally mutated at one byte.
PLAIN_HEADS = [
    b"HTTP/1.1 200 OK\r\nServer: nginx\r\nContent-Type: application/json\r\nContent-Length: 1024\r\n"
    b"Connection: keep-alive\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
    b"HTTP/1.1 404 Not Found\r\nContent-Length:0\r\n\r\n",
    b"HTTP/1.1 503 \r\nx-a:\t\r\ntransfer-encoding: CHUNKED\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 12\r\n\r\n",
]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/1.2", b"HTTP/2.0", b"http/1.1", b"HTTP/1.1 "]
STATUSES = [b"200", b"201", b"204", b"304", b"101", b"100", b"404", b"599", b"600", b"099", b"2000", b"20", b"2x0"]
REASONS = [b" OK", b" ", b"", b" a\tb", b" \x01", b" \x7f", b" \xc3\xa9", b" OK ", b"\tOK"]
NAMES = [
    b"Content-Length",
    b"content-length",
    b"CONTENT-LENGTH",
    b"Transfer-Encoding",
    b"transfer-encoding",
    b"Connection",
    b"Proxy-Connection",
    b"Upgrade",
    b"Keep-Alive",
    b"X-A",
    b"Content-Lengths",
    b"Content-Length ",
    b"",
    b"X A",
    b"X\x00",
    b"X-\xc3\xa9",
    b" X-A",
]
SEPARATORS = [b":", b": ", b":\t", b" : ", b":  "]
VALUES = [
    b"5",
    b"0",
    b"00",
    b"123456789012345678",
    b"1234567890123456789",
    b"99999999999999999999",
    b"5 ",
    b"-1",
    b"5,5",
    b"+5",
    b"0x5",
    b"chunked",
    b"Chunked",
    b"chunked, gzip",
    b"gzip, chunked",
    b"identity",
    b"chunked ",
    b"keep-alive",
    b"Keep-Alive",
    b"close",
    b"upgrade",
    b"keep-alive, close",
    b"text/plain",
    b"a\x01b",
    b"a\x7fb",
    b"\xc3\xa9",
    b"",
    b"a\tb",
]
EOLS = [b"\r\n", b"\r\n", b"\r\n", b"\n", b"\r\r\n"]


def piece(plain: list[bytes], other: list[bytes]) -> Any:
    """Mostly a piece of the plain form (else few heads would be), sometimes any."""
    return st.one_of(*[st.sampled_from(plain)] * 4, st.sampled_from(other))


PLAIN_LINES = [
    b"X-A: text/plain",
    b"Content-Length: 5",
    b"transfer-encoding:chunked",
    b"Connection: keep-alive",
    b"X-B:",
]


@st.composite
def response_heads(draw: Any) -> bytes:
    head = draw(piece([b"HTTP/1.1"], VERSIONS)) + b" " + draw(piece([b"200", b"404", b"599"], STATUSES))
    head += draw(piece([b" OK", b" ", b" a\tb"], REASONS)) + draw(piece([b"\r\n"], EOLS))
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 3)):
            head += draw(st.sampled_from(PLAIN_LINES))
        else:
            head += draw(st.sampled_from(NAMES)) + draw(st.sampled_from(SEPARATORS)) + draw(st.sampled_from(VALUES))
        head += draw(piece([b"\r\n"], EOLS))
    head += b"\r\n"
    if draw(st.integers(0, 3)) == 0:  # one byte replaced, inserted or removed
        at = draw(st.integers(0, len(head) - 1))
        byte = bytes([draw(st.integers(0, 255))])
        head = draw(
            st.sampled_from(
                [head[:at] + byte + head[at + 1 :], head[:at] + byte + head[at:], head[:at] + head[at + 1 :]]
            )
        )
    return head


def read_heads(parser: Any, data: bytes, method: str) -> list[object]:
    """Feed ``data`` as the engine does (a span up to each head's empty line) with ``method``
    (``feed_head`` or ``llhttp_head``): what each span gave, then the error, if any."""
    out: list[object] = []
    at = 0
    while (k := data.find(b"\r\n\r\n", at)) >= 0:
        try:
            status = getattr(parser, method)(data, at, k + 4)
        except ParseError as exc:
            return [*out, type(exc).__name__]
        out.append((status, parser.keep_alive, parser.length) if status else 0)
        at = k + 4
    return out


@COMPILED_ONLY
@pytest.mark.parametrize("head", PLAIN_HEADS)
def test_the_plainest_response_heads_are_read_without_llhttp_as_llhttp_reads_them(head: bytes) -> None:
    parser = LlhttpResponseParser()
    status = parser.llhttp_head(head, 0, len(head))
    assert plain_head(head) == (status, parser.keep_alive, parser.length)


def llhttp_reading(head: bytes) -> object:
    parser = LlhttpResponseParser()
    try:
        status = parser.llhttp_head(head, 0, len(head))
    except ParseError:
        return "refused"
    return (status, parser.keep_alive, parser.length) if status else 0


@COMPILED_ONLY
@pytest.mark.parametrize("head", PLAIN_HEADS)
def test_every_byte_of_a_plain_head_changed_is_read_as_llhttp_reads_it_or_left_to_llhttp(head: bytes) -> None:
    taken = 0
    for at in range(len(head) - 4):  # (the empty line stays: without it the engine feeds no head)
        for byte in b"\x00\t\r\n :,;Aa05-\x7f\x80\xff":
            changed = head[:at] + bytes([byte]) + head[at + 1 :]
            plain = plain_head(changed)
            if plain is not None:
                taken += 1
                assert plain == llhttp_reading(changed), changed
    assert taken > len(head) // 2  # many changes keep the plain form (letters in names and values, digits...)


@COMPILED_ONLY
@settings(max_examples=300, deadline=None)
@given(heads=st.lists(response_heads(), min_size=1, max_size=3))
def test_response_heads_are_read_as_llhttp_reads_them(heads: list[bytes]) -> None:
    # One head alone, where the plain reading either takes it as llhttp does or leaves it to it...
    for head in heads:
        plain = plain_head(head)
        if plain is not None:
            parser = LlhttpResponseParser()
            assert plain == (parser.llhttp_head(head, 0, len(head)), parser.keep_alive, parser.length), head
    # ...and the heads one after another on one connection, as the engine feeds them: the plain
    # reading leaves llhttp ready for the next head, whichever of the two reads it.
    data = b"".join(heads)
    assert read_heads(LlhttpResponseParser(), data, "feed_head") == read_heads(
        LlhttpResponseParser(), data, "llhttp_head"
    )
