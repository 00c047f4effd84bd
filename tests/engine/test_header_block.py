"""The header view the fast engine hands to the router and modes (``Router.route``,
``Router.on_response``): a read-only Mapping over the raw header block with the semantics of a
dict (lower-case name -> first value, decoded), and the raw-block scans the engine forwards and
relays with."""

from collections.abc import Mapping

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.engine.head import (
    HAS_CONNECTION,
    HAS_CONTENT_LENGTH,
    HAS_HOP,
    HAS_TRANSFER_ENCODING,
    HOST_INVALID,
    HOST_REPEATED,
    HOST_SEEN,
    LISTED,
    NAMES_HEADERS,
    HeaderBlock,
    copy_block,
    cut,
    decimal,
    first_value,
    has_header,
    head_end,
    header_values,
    locate,
    name_table,
    origin_form,
    reason_phrase,
    relay_block,
    scan_request,
    valid_host,
)
from sidecar.headers import lookup

HEADERS = (
    b"X-Worker: w1\r\nContent-Type:application/json\r\nx-worker: w2\r\nX-Raw: \t caf\xc3\xa9 \xff \r\nX_Under^: u\r\n"
)
EXPECTED = {"x-worker": "w1", "content-type": "application/json", "x-raw": "caf\u00e9 \udcff ", "x_under^": "u"}


def test_reads_like_the_first_value_dict() -> None:
    view = HeaderBlock(HEADERS)
    assert isinstance(view, Mapping)
    assert view["x-worker"] == "w1" and view.get("x-worker") == "w1"
    assert view.get("x-missing") is None and view.get("x-missing", "d") == "d"
    assert "content-type" in view and "x-missing" not in view and 3 not in view
    with pytest.raises(KeyError):
        view["x-missing"]
    assert len(view) == 4 and list(view) == list(EXPECTED)
    assert dict(view) == EXPECTED and view == EXPECTED and view != {"x-worker": "w1"}
    assert list(view.keys()) == list(EXPECTED) and list(view.values()) == list(EXPECTED.values())
    assert list(view.items()) == list(EXPECTED.items())
    assert view["x-raw"].encode("utf-8", "surrogateescape") == b"caf\xc3\xa9 \xff "  # nothing lost
    assert "X-Worker" not in view and view.get("x~under^") is None and "x-worke" not in view
    assert view["x_under^"] == "u"


@pytest.mark.parametrize("headers", [HeaderBlock(HEADERS), EXPECTED], ids=["block", "dict"])
def test_lookup_is_get_on_a_block_or_any_mapping(headers: Mapping[str, str]) -> None:
    assert [lookup(headers, name) for name in ("x-worker", "x-raw", "x-missing", "X-Worker")] == [
        "w1",
        "caf\u00e9 \udcff ",
        None,
        None,
    ]
    assert lookup(headers, None) is None  # type: ignore[arg-type]  # (an unset header name)


def test_is_read_only_and_unhashable() -> None:
    view = HeaderBlock(HEADERS)
    with pytest.raises(TypeError):
        view["x-worker"] = "w3"  # type: ignore[index]
    with pytest.raises(TypeError):
        hash(view)
    assert HeaderBlock(b"") == {} and len(HeaderBlock(b"")) == 0


def test_reads_a_block_inside_a_larger_buffer() -> None:
    raw = b"HTTP/1.1 200 OK\r\nX-A: 1\r\nX-B: 2\r\n\r\nbody X-C: 3\r\n"
    first, end = raw.index(b"\n") + 1, raw.index(b"\r\n\r\n") + 2
    view = HeaderBlock(raw, first, end)
    assert dict(view) == {"x-a": "1", "x-b": "2"} and "x-c" not in view
    assert header_values(raw, first, end, b"x-c", False) == []


def test_lookups_agree_with_a_dict_however_many_names_share_a_filter_bit() -> None:
    # 80 names: every length-and-last-letter bit of the lookup filter is taken by some name, and
    # many absent names share a bit with a present one (the scan must still tell them apart).
    names = [b"X-%s-%d" % (b"H" * (i % 23), i) for i in range(80)] + [b"X-AB", b"x-cB", b"Accept"]
    block = b"".join(b"%s: v%d\r\n" % (n, i) for i, n in enumerate(names))
    view = HeaderBlock(block)
    expected = {n.decode().lower(): f"v{i}" for i, n in enumerate(names)}
    for key, value in expected.items():
        assert view.get(key) == value
    for absent in ("x-bb", "x-ab-0", "accepT", "x-h-2", "accepts", "", "x-" + "h" * 22 + "-79"):
        assert view.get(absent) is None and absent not in view
    assert view == expected
    assert first_value(block, 0, len(block), b"x-cb") == b"v81"
    assert first_value(block, 0, len(block), b"x-c") is None


class _Name(str):
    """A str subclass (a key the filter's fast path does not take)."""


def test_keys_of_any_type_and_spelling_read_like_a_dict() -> None:
    block = HEADERS + b"X-Caf\xe9: latin\r\n"
    view = HeaderBlock(block)
    assert view.get(_Name("x-worker")) == "w1" and _Name("x-missing") not in view
    assert view.get("x-caf\u00e9") == "latin"  # a last character beyond ASCII, as its latin-1 byte
    assert view.get("x-w\u0151rker") is None and view.get("x-caf\u0151") is None  # not latin-1
    assert view.get(b"x-worker") is None and view.get(3) is None and view.get(None, "d") == "d"  # type: ignore[call-overload]
    for _ in range(2):  # the second lookup of each name reads its bytes from the cache
        assert [view.get(k) for k in ("x-worker", "x-raw", "x_under^", "content-type")] == [
            "w1",
            EXPECTED["x-raw"],
            "u",
            "application/json",
        ]


REQUEST_BLOCK = (
    b"Host: h\r\nX-Keep: 1\r\nconnection: close\r\nX-Strip-Me: s\r\nX-KEEP: 2\r\n"
    b"Expect: 100-continue\r\nAccept:  */* \r\n"
)


def test_copy_block_drops_listed_names_and_keeps_the_rest_byte_for_byte() -> None:
    table = name_table(frozenset({"host", "connection", "x-strip-me", "expect"}))
    out: list[bytes] = [b"HEAD"]
    copy_block(REQUEST_BLOCK, 0, len(REQUEST_BLOCK), out, table)
    assert out[0] == b"HEAD"
    assert b"".join(out[1:]) == b"X-Keep: 1\r\nX-KEEP: 2\r\nAccept:  */* \r\n"
    out = []
    copy_block(REQUEST_BLOCK, 0, len(REQUEST_BLOCK), out, name_table(frozenset()))
    assert out == [REQUEST_BLOCK]
    assert name_table(frozenset({"te", "connection"})) is name_table(frozenset({"connection", "te"}))


def test_scan_request_and_has_header_match_whole_names_in_any_case() -> None:
    block = REQUEST_BLOCK
    assert scan_request(block, 0, len(block), name_table(frozenset({"x-strip-me"}))) & LISTED
    assert scan_request(block, 0, len(block), name_table(frozenset({"upgrade", "expect"}))) & LISTED
    assert not scan_request(block, 0, len(block), name_table(frozenset({"x-strip", "x-keep-", "upgrade"}))) & LISTED
    assert has_header(block, 0, len(block), b"connection") and has_header(block, 0, len(block), b"x-keep")
    assert not has_header(block, 0, len(block), b"x-kee") and not has_header(block, 0, len(block), b"transfer")
    assert header_values(block, 0, len(block), b"x-keep", False) == [b"1", b"2"]


BLOCK = (
    b"Server: up\r\nConnection: keep-alive, X-Private\r\nContent-Length: 2\r\nX-Private: p\r\n"
    b"keep-ALIVE: timeout=5\r\nTE: trailers\r\nX-End: kept\r\nTransfer-Encoding: chunked\r\n"
)


def test_relay_block_keeps_end_to_end_lines_as_sent() -> None:
    out: list[bytes] = []
    bits = relay_block(BLOCK, 0, len(BLOCK), out, None)
    assert bits == HAS_CONNECTION | NAMES_HEADERS | HAS_CONTENT_LENGTH | HAS_HOP | HAS_TRANSFER_ENCODING
    assert out == [b"Server: up\r\n", b"Content-Length: 2\r\nX-Private: p\r\n", b"X-End: kept\r\n"]
    out = [b"status\r\n"]
    relay_block(BLOCK, 0, len(BLOCK), out, {"x-private"})
    assert out == [b"status\r\n", b"Server: up\r\n", b"Content-Length: 2\r\n", b"X-End: kept\r\n"]
    plain = b"A: 1\r\nB: 2\r\n"
    out = []
    assert relay_block(plain, 0, len(plain), out, None) == 0 and out == [plain]


@pytest.mark.parametrize(
    ("block", "names"),
    [
        (b"Connection: keep-alive\r\n", False),
        (b"connection:  Keep-ALIVE\r\n", False),
        (b"Connection: close\r\n", False),
        (b"Connection: keep-alive \r\n", True),
        (b"Connection: x-a\r\n", True),
        (b"Connection: keep-alive\r\nConnection: close\r\n", True),
        (b"Connection: closed\r\n", True),
        (b"Connection:\r\n", True),
    ],
)
def test_a_connection_header_names_more_unless_it_is_one_plain_token(block: bytes, names: bool) -> None:
    out: list[bytes] = []
    bits = relay_block(b"A: 1\r\n" + block + b"B: 2\r\n", 0, 1000, out, None)
    assert bits == HAS_CONNECTION | (NAMES_HEADERS if names else 0)
    assert out == [b"A: 1\r\n", b"B: 2\r\n"]


def test_header_values_in_order() -> None:
    assert header_values(BLOCK, 0, len(BLOCK), b"connection", False) == [b"keep-alive, X-Private"]
    assert header_values(HEADERS, 0, len(HEADERS), b"x-worker", False) == [b"w1", b"w2"]
    assert header_values(HEADERS, 0, len(HEADERS), b"x-worker", True) == [b"w1"]
    assert header_values(HEADERS, 0, len(HEADERS), b"x-missing", False) == []


def test_cut_is_a_slice_within_the_bytes() -> None:
    raw = b"HTTP/1.1 200 OK\r\n"
    spans = [(0, len(raw)), (9, 12), (4, 4), (12, 9), (len(raw), len(raw)), (0, 0)]
    assert [cut(raw, start, stop) for start, stop in spans] == [raw[start:stop] for start, stop in spans]
    assert cut(b"", 0, 0) == b"" and type(cut(raw, 0, 4)) is bytes


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 200 OK\r\nA: 1\r\n\r\nbody\r\n\r\n",
        b"\r\n\r\n",
        b"\r\r\n\r\r\n\r\n\r\n",
        b"\n\r\n\r\n\n",
        b"A: 1\r\nB: 2\r\n\r",
        b"xxxxxxx\r\n\r\n",
        b"",
        b"\r\n\r",
    ],
)
def test_head_end_finds_the_first_blank_line_from_any_start(raw: bytes) -> None:
    for at in range(len(raw) + 2):
        assert head_end(raw, at) == raw.find(b"\r\n\r\n", at), at


@given(st.lists(st.sampled_from([b"a", b"\r", b"\n", b"\r\n"]), max_size=24))
def test_head_end_agrees_with_find_on_any_mix_of_cr_and_lf(pieces: list[bytes]) -> None:
    raw = b"".join(pieces)
    for at in range(len(raw) + 1):
        assert head_end(raw, at) == raw.find(b"\r\n\r\n", at)


def test_decimal_is_the_digits_of_a_length() -> None:
    for n in (0, 7, 1024, 10**12, 2**63 - 1, 2**64 - 1):
        assert decimal(n) == b"%d" % n


@pytest.mark.parametrize(
    ("raw", "at", "expected", "phrase"),
    [
        (b"HTTP/1.1 200 OK\r\nA: 1\r\n\r\nbody", 0, (0, 17, 23), b"OK"),
        (b"HTTP/1.1 204 No Content\r\n\r\n", 0, (0, 25, 25), b"No Content"),
        (b"\r\n\r\nHTTP/1.1 299\r\nA: 1\r\n\r\n", 0, (4, 18, 24), b""),
        (b"HTTP/1.1 103 Early\r\n\r\nICE/1.0 200 \r\nA: 1\r\n\r\n", 22, (22, 36, 42), b""),
    ],
)
def test_locate_finds_the_start_line_and_the_block(
    raw: bytes, at: int, expected: tuple[int, int, int], phrase: bytes
) -> None:
    start, first, end = locate(raw, at)
    assert (start, first, end) == expected and raw[end : end + 2] == b"\r\n"
    assert reason_phrase(raw, start, first) == phrase


HOSTS_VALID = [
    b"",
    b"example.com",
    b"example.com:8080",
    b"EXAMPLE.com:",
    b"10.0.0.1",
    b"10.0.0.1:80",
    b"[::1]",
    b"[::1]:443",
    b"[v1.fe80::a+en1]",
    b"a-b_c.~d",
    b"%41bc",
    b"x!$&'()*+,;=y",
    b"localhost  ",
    b"h\t",
]
HOSTS_INVALID = [
    b"user@example.com",
    b"user:pw@h",
    b"a/b",
    b"a?b",
    b"a#b",
    b"a b",
    b"[::1",
    b"[]",
    b"[::1]x",
    b"h:80:90",
    b"h:8o",
    b"%4",
    b"%zz",
    b"caf\xc3\xa9",
    b"a\\b",
    b'"h"',
    b"<h>",
    b"h:-1",
]


@pytest.mark.parametrize("value", HOSTS_VALID)
def test_valid_host_accepts_uri_host_and_port(value: bytes) -> None:
    assert valid_host(value, 0, len(value))
    block = b"Host: " + value + b"\r\nX-A: 1\r\n"
    assert scan_request(block, 0, len(block), name_table(frozenset({"x-b"}))) == HOST_SEEN


@pytest.mark.parametrize("value", HOSTS_INVALID)
def test_valid_host_refuses_userinfo_paths_and_odd_bytes(value: bytes) -> None:
    assert not valid_host(value, 0, len(value))
    block = b"X-A: 1\r\nhost: " + value + b"\r\n"
    assert scan_request(block, 0, len(block), name_table(frozenset({"x-a"}))) == LISTED | HOST_SEEN | HOST_INVALID


def test_scan_request_counts_host_lines() -> None:
    table = name_table(frozenset({"connection"}))
    assert scan_request(b"X-A: 1\r\n", 0, 8, table) == 0
    two = b"Host: a\r\nHOST: b\r\n"
    assert scan_request(two, 0, len(two), table) == HOST_SEEN | HOST_REPEATED
    # A name that only starts like Host is another header.
    other = b"Hostname: a\r\nX-Host: b\r\nHost: c\r\n"
    assert scan_request(other, 0, len(other), table) == HOST_SEEN


@pytest.mark.parametrize(
    ("target", "origin"),
    [
        (b"http://h.example/v1/chat?x=1", b"/v1/chat?x=1"),
        (b"HTTPS://h.example:443", b"/"),
        (b"http://h.example?q", b"/?q"),
        (b"http://[::1]:8080/a", b"/a"),
        (b"http://user@h.example/a", None),
        (b"http:///a", None),
        (b"ftp://h/a", None),
        (b"h.example:443", None),
        (b"*", None),
        (b"http://h.example/a#frag", None),
        (b"http://h example/a", None),
    ],
)
def test_origin_form_of_absolute_targets(target: bytes, origin: bytes | None) -> None:
    assert origin_form(target) == origin
