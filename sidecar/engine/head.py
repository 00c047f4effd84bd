# cython: boundscheck=False
# (every index below is checked against the block's end, itself clamped to the bytes' length)
"""Header blocks of HTTP/1.1 heads that llhttp accepted, read from their raw bytes.

The engine runs llhttp strict (no lenient flags): a head it accepts has lines ending in CRLF,
field names that are tokens followed directly by ``:``, and values without CR, LF or controls
other than HT. So once llhttp accepted a head, each header line is ``name ":" OWS value CRLF``,
and the scans here need no validation of their own. Reading the raw bytes instead of taking a
Python callback per header lets llhttp parse the head in C, and lets the engine copy the lines
it keeps (request and response) as a few slices. (The pure-Python build's request parser
builds blocks of the same shape from httptools' callbacks: see
:mod:`sidecar.engine.parsers`.)

A *block* is ``raw[first:end]``: the header lines of one head, each ending in CRLF, without the
start line and without the blank line that ends the head. Values are as llhttp reports them:
leading whitespace skipped, trailing whitespace kept.
"""

from __future__ import annotations

import sys
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from typing import Any

from sidecar import headers as h
from sidecar.compiled import is_compiled
from sidecar.headers import HeaderView

# Classes of header names, as bits: what the relay drops (hop-by-hop) and what framing reads.
HAS_CONNECTION = 1
HAS_CONTENT_LENGTH = 2
HAS_TRANSFER_ENCODING = 4
HAS_HOP = 8  # any other hop-by-hop header
# A Connection header that may name more headers to drop: anything but one line whose value is
# exactly ``keep-alive`` or ``close`` (in any case).
NAMES_HEADERS = 16
# Typed copies for the scans (compiled, module constants would be Python objects).
_CONNECTION_BIT = HAS_CONNECTION
_NAMES_BIT = NAMES_HEADERS
_DROPPED = HAS_CONNECTION | HAS_TRANSFER_ENCODING | HAS_HOP

# The lower-case keys the router and modes look up, as bytes: the handful of names a
# configuration reads come from this cache; lookups of other names beyond the bound encode.
_KEY_BYTES: dict[str, bytes] = {}
MAX_KEYS = 1024


def _classes() -> list[tuple[tuple[bytes, int], ...]]:
    """The classified names (lower-case bytes) by length: ``_BY_LENGTH[len(name)]``."""
    bits = {n: HAS_HOP for n in h.HOP_BY_HOP}
    bits.update(
        {
            h.CONNECTION.lower(): HAS_CONNECTION,
            h.TRANSFER_ENCODING.lower(): HAS_TRANSFER_ENCODING,
            h.CONTENT_LENGTH.lower(): HAS_CONTENT_LENGTH,
        }
    )
    by_length: list[tuple[tuple[bytes, int], ...]] = [() for _ in range(max(map(len, bits)) + 1)]
    for name, bit in bits.items():
        by_length[len(name)] += ((name.encode(), bit),)
    return by_length


_BY_LENGTH = tuple(_classes())
_CLASS_OF = {name: bit for names in _BY_LENGTH for name, bit in names}  # (uncompiled scans)
_LONGEST = len(_BY_LENGTH) - 1
_HOST = b"host"
_KEEP_ALIVE = b"keep-alive"
_CLOSE = b"close"
_PLAIN = (_KEEP_ALIVE, _CLOSE)
# Character classes of Host values (valid_host), one byte of bits per byte value.
_REG_NAME, _IP_LITERAL, _HEX = 1, 2, 4


def _host_classes() -> bytes:
    classes = bytearray(256)
    for c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~!$&'()*+,;=%":
        classes[c] |= _REG_NAME
    for c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~!$&'()*+,;=:":
        classes[c] |= _IP_LITERAL  # IPv6 and IPvFuture addresses in brackets
    for c in b"0123456789ABCDEFabcdef":
        classes[c] |= _HEX
    return bytes(classes)


_HOST_CLASS = _host_classes()
# name_table's cache (a handful of sets: one per deployment's strip list, a few variants).
_TABLES: dict[frozenset[str], tuple[tuple[bytes, ...], ...]] = {}
MAX_TABLES = 256


def _clamp(raw: bytes, first: int, end: int) -> tuple[int, int]:
    """``first`` and ``end`` within ``raw`` (the scans index without bounds checks)."""
    n = len(raw)
    return (0 if first < 0 else n if first > n else first), (n if end > n or end < 0 else end)


def cut(raw: bytes, start: int, stop: int) -> bytes:
    """``raw[start:stop]`` for ``0 <= start`` and ``stop <= len(raw)`` (unchecked; a ``stop``
    before ``start`` gives ``b""``). Compiled, one copy out of the bytes' buffer (head.pxd types
    ``p`` as a C pointer): a slice would first make a slice object and two ints, a few hundred
    instructions a call on the per-request path."""
    if stop <= start:
        return b""
    p = raw
    return p[start:stop]


def head_end(raw: bytes, at: int) -> int:
    """Where the first CRLF CRLF at or after ``at`` (``>= 0``) starts in ``raw``, -1 without one:
    ``raw.find(b"\\r\\n\\r\\n", at)``. Compiled, a C loop that steps four bytes past any byte
    that is neither CR nor LF (no match can hold it), instead of the method call's argument
    parsing."""
    n = len(raw)
    i = at + 3
    while i < n:
        c = raw[i]
        if c == 10:
            if raw[i - 1] == 13 and raw[i - 2] == 10 and raw[i - 3] == 13:
                return i - 3
            i += 2  # this LF can only be a match's second byte
        elif c == 13:
            i += 1  # this CR can be a match's first or third byte
        else:
            i += 4
    return -1


def decimal(n: int) -> bytes:
    """``b"%d" % n`` for ``0 <= n < 2**64``. Compiled, digits written in a C buffer: the bytes
    ``%`` operator, or an f-string then its encoding, cost several hundred instructions per call."""
    if _COMPILED:
        return decimal_bytes(n)  # type: ignore[name-defined]  # noqa: F821  # cimported (head.pxd)
    return f"{n}".encode("ascii")


def _find(raw: bytes, c: int, i: int, end: int) -> int:
    """Index of the first byte ``c`` in ``raw[i:end]``, ``end`` if there is none. (Compiled,
    memchr: every scan of a head finds its lines with this.)"""
    if _COMPILED:
        return find_byte(raw, c, i, end)  # type: ignore[name-defined]  # noqa: F821  # cimported (head.pxd)
    while i < end and raw[i] != c:
        i += 1
    return i


def _line(raw: bytes, at: int, end: int) -> tuple[int, int]:
    """The ``:`` and the LF of the header line that starts at ``at`` (``end`` for one missing)."""
    colon = _find(raw, 58, at, end)
    return colon, _find(raw, 10, colon, end)


def _value_at(raw: bytes, colon: int, eol: int) -> int:
    """Where the value of the line with ``:`` at ``colon`` and LF at ``eol`` starts (after OWS)."""
    v = colon + 1
    while v < eol and (raw[v] == 32 or raw[v] == 9):
        v += 1
    return v


def _same(raw: bytes, at: int, lower: bytes) -> bool:
    """``raw[at:at + len(lower)]`` is ``lower`` (a lower-case name) but for the case of letters
    (the caller checked the length)."""
    for k in range(len(lower)):
        c = raw[at + k]
        if 65 <= c <= 90:  # A-Z
            c += 32
        if c != lower[k]:
            return False
    return True


def _class(raw: bytes, at: int, n: int) -> int:
    """The HAS_* bit of the header name ``raw[at:at + n]`` (``n <= _LONGEST``), 0 for an
    end-to-end header."""
    for name, bit in _BY_LENGTH[n]:
        if _same(raw, at, name):
            return bit
    return 0


def _plain_connection(raw: bytes, colon: int, eol: int) -> bool:
    """The value of this Connection line is exactly ``keep-alive`` or ``close``."""
    v = _value_at(raw, colon, eol)
    n = eol - 1 - v  # up to the CR
    return (n == 10 and _same(raw, v, _KEEP_ALIVE)) or (n == 5 and _same(raw, v, _CLOSE))


def locate(raw: bytes, at: int) -> tuple[int, int, int]:
    """Where the head llhttp accepted in ``raw`` from ``at`` on lies: ``(start, first, end)`` with
    the start line at ``raw[start:first]`` and the block at ``raw[first:end]``; ``end + 2`` is
    where the head ends. Before ``start``: the CR/LF llhttp skips before a message."""
    n = len(raw)
    start = 0 if at < 0 else at
    while start < n and (raw[start] == 13 or raw[start] == 10):
        start += 1
    first = _find(raw, 10, start, n) + 1
    end = first
    while end < n and raw[end] != 13:  # a header line starts with a name, the blank line with CR
        end = _find(raw, 10, end, n) + 1
    return start, first, end


def reason_phrase(raw: bytes, start: int, first: int) -> bytes:
    """The reason phrase of the status line ``raw[start:first]`` (llhttp checked its form:
    ``<version> SP <3 digits> [SP reason] CRLF``)."""
    return cut(raw, _find(raw, 32, start, first) + 5, first - 2)


def relay_block(raw: bytes, first: int, end: int, out: list[bytes], extra: set[str] | None) -> int:
    """Append the lines of the block ``raw[first:end]`` to ``out`` minus the hop-by-hop ones and
    the end-to-end ones ``extra`` names (lower-case keys; a name that frames the message, such as
    Content-Length, is never dropped through ``extra``), as few slices as possible (each run of kept lines is
    one); return the HAS_* bits of the names in the block, plus NAMES_HEADERS when a Connection
    header may name more (then the caller relays again with those names as ``extra``)."""
    first, end = _clamp(raw, first, end)  # (the C scans index without bounds checks)
    bits = 0
    run = first  # start of the current run of kept lines
    i = first
    while i < end:
        at = i
        colon, eol = _line(raw, i, end)
        i = eol + 1
        n = colon - at
        cls = _class(raw, at, n) if n <= _LONGEST and _BY_LENGTH[n] else 0
        if cls == _CONNECTION_BIT and (bits & _CONNECTION_BIT or not _plain_connection(raw, colon, eol)):
            bits |= _NAMES_BIT
        bits |= cls
        # ``extra`` (the names a Connection header lists) drops end-to-end fields only: the
        # classified ones, framing among them, are decided by their class alone.
        if cls & _DROPPED or (cls == 0 and extra is not None and raw[at:colon].decode("latin-1").lower() in extra):
            if at > run:
                out.append(cut(raw, run, at))
            run = i
    if end > run:
        out.append(cut(raw, run, end))
    return bits


def _next_value(raw: bytes, i: int, end: int, lower: bytes) -> tuple[int, int]:
    """The first line of ``raw[i:end]`` with the header ``lower``: where its value starts and
    its LF; ``(-1, end)`` if there is none."""
    n = len(lower)
    while i < end:
        at = i
        eol = _find(raw, 10, i, end)
        i = eol + 1
        # A name is a token (no ":"): the line has this name if ":" follows its first n bytes.
        if at + n < eol and raw[at + n] == 58 and _same(raw, at, lower):
            return _value_at(raw, at + n, eol), eol
    return -1, end


def header_values(raw: bytes, first: int, end: int, lower: bytes, first_only: bool) -> list[bytes]:
    """The values of the header ``lower`` (a lower-case name) in the block ``raw[first:end]``, in
    order (only the first with ``first_only``)."""
    first, end = _clamp(raw, first, end)  # (the C scans index without bounds checks)
    out: list[bytes] = []
    v, eol = _next_value(raw, first, end, lower)
    while v >= 0:
        out.append(cut(raw, v, eol - 1))
        if first_only:
            break
        v, eol = _next_value(raw, eol + 1, end, lower)
    return out


def first_value(raw: bytes, first: int, end: int, lower: bytes) -> bytes | None:
    """The first value of the header ``lower`` (a lower-case name) in the block ``raw[first:end]``,
    None without one."""
    first, end = _clamp(raw, first, end)  # (the C scans index without bounds checks)
    v, eol = _next_value(raw, first, end, lower)
    return cut(raw, v, eol - 1) if v >= 0 else None


def name_table(names: frozenset[str]) -> tuple[tuple[bytes, ...], ...]:
    """``names`` (lower-case keys) as the scans below take them: lower-case bytes by length,
    ``table[len(name)]`` (cached: the engine asks for a few sets, once per request each)."""
    table = _TABLES.get(names)
    if table is None:
        by_length: list[tuple[bytes, ...]] = [() for _ in range(max(map(len, names), default=0) + 1)]
        for name in names:
            by_length[len(name)] += (name.encode("latin-1"),)
        table = tuple(by_length)
        if len(_TABLES) < MAX_TABLES:
            _TABLES[names] = table
    return table


def _listed(raw: bytes, at: int, n: int, table: tuple[tuple[bytes, ...], ...]) -> bool:
    """The header name ``raw[at:at + n]`` is in ``table``."""
    if n >= len(table):
        return False
    names = table[n]
    for name in names:
        if _same(raw, at, name):
            return True
    return False


def _next_listed(raw: bytes, i: int, end: int, table: tuple[tuple[bytes, ...], ...]) -> tuple[int, int]:
    """The first line of ``raw[i:end]`` whose name is in ``table``: where it starts and where
    the next line starts; ``(end, end)`` if there is none."""
    while i < end:
        at = i
        colon, eol = _line(raw, i, end)
        i = eol + 1
        if _listed(raw, at, colon - at, table):
            return at, i
    return end, end


def copy_block(raw: bytes, first: int, end: int, out: list[bytes], table: tuple[tuple[bytes, ...], ...]) -> None:
    """Append the lines of the block ``raw[first:end]`` whose names are not in ``table`` (see
    :func:`name_table`) to ``out``, byte for byte, one slice per run of kept lines."""
    first, end = _clamp(raw, first, end)  # (the C scans index without bounds checks)
    run = first
    at, nxt = _next_listed(raw, first, end, table)
    while at < end:
        if at > run:
            out.append(cut(raw, run, at))
        run = nxt
        at, nxt = _next_listed(raw, nxt, end, table)
    if end > run:
        out.append(cut(raw, run, end))


# What scan_request reports, as bits.
LISTED = 1  # a header whose name is in the table
HOST_SEEN = 2  # a Host line
HOST_REPEATED = 4  # more than one Host line
HOST_INVALID = 8  # a Host value that is not ``uri-host [":" port]``
# Typed copies for scan_request (compiled, the names above are Python objects: looked up and
# combined as Python ints on every line otherwise).
_LISTED, _HOST_SEEN, _HOST_REPEATED, _HOST_INVALID = LISTED, HOST_SEEN, HOST_REPEATED, HOST_INVALID


def scan_request(raw: bytes, first: int, end: int, table: tuple[tuple[bytes, ...], ...]) -> int:
    """The request-level facts of the block ``raw[first:end]`` in one scan, as bits: LISTED when a
    header's name is in ``table`` (see :func:`name_table`), HOST_SEEN / HOST_REPEATED for one or
    more Host lines, HOST_INVALID when a Host value is not a valid ``uri-host [":" port]``."""
    first, end = _clamp(raw, first, end)  # (the C scans index without bounds checks)
    bits = 0
    i = first
    while i < end:
        at = i
        colon, eol = _line(raw, i, end)
        i = eol + 1
        n = colon - at
        if n == 4 and _same(raw, at, _HOST):
            bits |= _HOST_REPEATED if bits & _HOST_SEEN else _HOST_SEEN
            if not valid_host(raw, _value_at(raw, colon, eol), eol - 1):
                bits |= _HOST_INVALID
        elif not bits & _LISTED and _listed(raw, at, n, table):
            bits |= _LISTED
    return bits


# What a request refused for :func:`dot_segment` is told.
DOT_SEGMENT = "request target has a . or .. path segment"


def dot_segment(target: bytes) -> bool:
    """``target``'s path (up to any ``?``) has a ``.`` or ``..`` segment, plain or
    percent-encoded (``%2e``): where a gateway resolves it (RFC 3986 5.2.4), a request would
    leave the path prefix of the upstream's URL that the sidecar put in front of it.

    Compiled, the common case (no ``/.`` and no ``%2`` in the path) is one C loop over the
    path; two ``find`` calls cost about two thousand instructions on every request."""
    n = len(target) - 1
    i = 0
    while i < n:
        c = target[i]
        if c == 63:  # "?": the query follows
            return False
        if (c == 47 and target[i + 1] == 46) or (c == 37 and target[i + 1] == 50):  # "/." or "%2"
            return _dot_segments(target)
        i += 1
    return False


def _dot_segment_py(target: bytes) -> bool:
    # The interpreted build's common case: two scans. (find, not ``in``: bytes' ``in`` first
    # tries its operand as an integer, which raises and clears a TypeError per test.)
    if target.find(b"/.") < 0 and target.find(b"%2") < 0:
        return False
    return _dot_segments(target)


def _dot_segments(target: bytes) -> bool:
    """The segments of ``target``'s path, checked one by one (see :func:`dot_segment`)."""
    q = target.find(b"?")
    path = target if q < 0 else target[:q]
    for seg in path.split(b"/"):
        if 0 < len(seg) <= 6:
            seg = seg.lower().replace(b"%2e", b".")
            if seg == b"." or seg == b"..":
                return True
    return False


def origin_form(target: bytes) -> bytes | None:
    """The origin-form (``/path?query``) of an absolute-form request target
    (``http://authority/path?query``, scheme in any case), None when ``target`` is not one or its
    authority is not a valid ``uri-host[:port]`` (userinfo included: RFC 9110 4.2.4)."""
    scheme = target[:8].lower()
    if scheme.startswith(b"http://"):
        rest = target[7:]
    elif scheme.startswith(b"https://"):
        rest = target[8:]
    else:
        return None
    cut = len(rest)
    for sep in (b"/", b"?", b"#"):
        j = rest.find(sep)
        if 0 <= j < cut:
            cut = j
    path = rest[cut:]
    if cut == 0 or not valid_host(rest, 0, cut) or path.find(b"#") >= 0:
        return None
    return path if path.startswith(b"/") else b"/" + path


def valid_host(raw: bytes, start: int, stop: int) -> bool:
    """``raw[start:stop]`` (trailing whitespace ignored) is a Host value: empty, or ``uri-host
    [":" port]`` where uri-host is an IP literal in brackets or a reg-name / IPv4 address
    (unreserved, sub-delims and percent-encoded characters): no userinfo (``@``), path, query,
    whitespace or non-ASCII (RFC 9112 3.2, RFC 3986 3.2.2)."""
    while stop > start and (raw[stop - 1] == 32 or raw[stop - 1] == 9):
        stop -= 1
    i = start
    if i < stop and raw[i] == 91:  # "[" IP-literal "]"
        i += 1
        while i < stop and _HOST_CLASS[raw[i]] & _IP_LITERAL:
            i += 1
        if i >= stop or raw[i] != 93 or i == start + 1:
            return False
        i += 1
    else:
        while i < stop and _HOST_CLASS[raw[i]] & _REG_NAME:
            if raw[i] == 37:  # "%" HEXDIG HEXDIG
                if i + 2 >= stop or not _HOST_CLASS[raw[i + 1]] & _HEX or not _HOST_CLASS[raw[i + 2]] & _HEX:
                    return False
                i += 2
            i += 1
    if i < stop:
        if raw[i] != 58:  # ":" port
            return False
        i += 1
        while i < stop:
            if not 48 <= raw[i] <= 57:
                return False
            i += 1
    return True


def has_header(raw: bytes, first: int, end: int, lower: bytes) -> bool:
    """The block ``raw[first:end]`` has a header ``lower`` (a lower-case name)."""
    return first_value(raw, first, end, lower) is not None


# Interpreted, the scans above cost a Python operation per byte: these versions of them do the
# same with bytes methods (the same contracts; the test suite runs on both builds). They replace
# the scans at import time in the interpreted build (see the end of the module).


def _head_end_py(raw: bytes, at: int) -> int:
    return raw.find(b"\r\n\r\n", at)


def _locate_py(raw: bytes, at: int) -> tuple[int, int, int]:
    n = len(raw)
    start = 0 if at < 0 else at
    while start < n and (raw[start] == 13 or raw[start] == 10):
        start += 1
    lf = raw.find(b"\n", start)
    first = n + 1 if lf < 0 else lf + 1
    blank = raw.find(b"\r\n\r\n", first - 2)
    return start, first, (n if blank < 0 else blank + 2)


def _relay_block_py(raw: bytes, first: int, end: int, out: list[bytes], extra: set[str] | None) -> int:
    bits = 0
    dropped = []
    at = first
    for line in raw[first:end].split(b"\r\n")[:-1]:
        colon = line.find(b":")
        name = line[:colon].lower()
        cls = _CLASS_OF.get(name, 0)
        if cls == HAS_CONNECTION and (bits & HAS_CONNECTION or line[colon + 1 :].lstrip(b" \t").lower() not in _PLAIN):
            bits |= NAMES_HEADERS
        bits |= cls
        nxt = at + len(line) + 2
        if cls & _DROPPED or (cls == 0 and extra is not None and name.decode("latin-1") in extra):
            dropped.append((at, nxt))
        at = nxt
    _keep_runs(raw, first, end, out, dropped)
    return bits


def _copy_block_py(raw: bytes, first: int, end: int, out: list[bytes], table: tuple[tuple[bytes, ...], ...]) -> None:
    dropped = []
    at = first
    for line in raw[first:end].split(b"\r\n")[:-1]:
        name = line[: line.find(b":")].lower()
        nxt = at + len(line) + 2
        if len(name) < len(table) and name in table[len(name)]:
            dropped.append((at, nxt))
        at = nxt
    _keep_runs(raw, first, end, out, dropped)


def _keep_runs(raw: bytes, first: int, end: int, out: list[bytes], dropped: list[tuple[int, int]]) -> None:
    """Append ``raw[first:end]`` minus the ``dropped`` spans (in order) to ``out``, a slice per run."""
    run = first
    for at, nxt in dropped:
        if at > run:
            out.append(raw[run:at])
        run = nxt
    if end > run:
        out.append(raw[run:end])


def _scan_request_py(raw: bytes, first: int, end: int, table: tuple[tuple[bytes, ...], ...]) -> int:
    bits = 0
    for line in raw[first:end].split(b"\r\n")[:-1]:
        colon = line.find(b":")
        name = line[:colon].lower()
        if name == _HOST:
            bits |= HOST_REPEATED if bits & HOST_SEEN else HOST_SEEN
            value = line[colon + 1 :].lstrip(b" \t")
            if not valid_host(value, 0, len(value)):
                bits |= HOST_INVALID
        elif len(name) < len(table) and name in table[len(name)]:
            bits |= LISTED
    return bits


def _first_value_py(raw: bytes, first: int, end: int, lower: bytes) -> bytes | None:
    found = _header_values_py(raw, first, end, lower, True)
    return found[0] if found else None


def _header_values_py(raw: bytes, first: int, end: int, lower: bytes, first_only: bool) -> list[bytes]:
    out = []
    block = raw[first:end]
    lowered = block.lower()  # ASCII letters only, as the compiled compare folds them
    key = lower + b":"
    i = lowered.find(key)
    while i >= 0:
        if i == 0 or lowered[i - 1] == 10:  # at a line start (values hold no LF)
            out.append(block[i + len(key) : block.find(b"\r\n", i)].lstrip(b" \t"))
            if first_only:
                break
        i = lowered.find(key, i + 1)
    return out


def token_set(values: list[bytes]) -> set[str]:
    """Lower-cased comma-separated tokens of header values (``Connection``)."""
    out = set()
    for value in values:
        for token in value.split(b","):
            token = token.strip().lower()
            if token:
                out.add(token.decode("latin-1"))
    return out


_MISSING = object()


def decoded(raw: bytes, first: int, end: int) -> dict[str, str]:
    """The block ``raw[first:end]`` as a dict: lower-case name -> first value, decoded."""
    out: dict[str, str] = {}
    for line in raw[first:end].split(b"\r\n")[:-1]:
        name, _, value = line.partition(b":")
        key = name.decode("latin-1").lower()
        if key not in out:
            out[key] = value.lstrip(b" \t").decode("utf-8", "surrogateescape")
    return out


def header_map(raw: bytes, first: int, end: int) -> Mapping[str, str]:
    """What the router reads a block through: compiled, a :class:`HeaderBlock` (its lookups scan
    in C, and most names looked up are absent); interpreted, the :func:`decoded` dict (the
    interpreter decodes a block once faster than it scans it per lookup)."""
    return HeaderBlock(raw, first, end)  # type: ignore[return-value]  # reads as a Mapping: get, in, []


def _bit(n: int, last: int) -> int:
    """The bit of :meth:`HeaderBlock.get`'s filter for a name of ``n`` bytes (``n > 0``) whose
    last byte is ``last``, case folded: bits 0-62."""
    return (n * 7 + (last | 32)) % 63


def _name_bit(raw: bytes, at: int, n: int) -> int:
    """:func:`_bit` of the name ``raw[at:at + n]``."""
    return _bit(n, raw[at + n - 1])


def _name_mask(raw: bytes, first: int, end: int) -> int:
    """The filter of the block ``raw[first:end]``: the bits of its names, plus bit 63."""
    one = 1  # (compiled, a 64-bit unsigned: see head.pxd)
    mask = one << 63
    i = first
    while i < end:
        at = i
        colon, eol = _line(raw, i, end)
        i = eol + 1
        if colon > at:
            mask |= one << _name_bit(raw, at, colon - at)
    return mask


def _key_bytes(key: Any) -> bytes | None:
    """A name looked up, as the bytes the scans compare (kept for the next lookup of a str);
    None when no header can have it (not a str, empty, or not latin-1)."""
    try:
        lower = key.encode("latin-1")
    except (AttributeError, UnicodeEncodeError):
        return None
    if not lower:
        return None
    if type(key) is str and len(_KEY_BYTES) < MAX_KEYS:
        _KEY_BYTES[key] = lower
    return lower


class HeaderBlock(HeaderView):
    """A head's headers as the router reads them, a read-only ``Mapping[str, str]`` over the raw
    block: lower-case name -> first value, decoded on lookup (the router reads a few names per
    request or response, most of them absent; decoding every header costs more). Compiled, the
    first lookup also builds a 64-bit filter of the names present, so a name that is absent
    (usually) costs no scan. Not a Mapping subclass (compiled, it is an extension type, which
    cannot derive from one): registered as one, with the full read-only API."""

    __slots__ = ("_raw", "_first", "_end", "_mask", "_decoded")

    def __init__(self, raw: bytes, first: int = 0, end: int = -1) -> None:
        self._raw = raw
        self._first, self._end = _clamp(raw, first, len(raw) if end < 0 else end)
        self._mask = 0  # _name_mask's filter once built (compiled only)
        self._decoded: dict[str, str] | None = None  # _dict() once built

    def get(self, key: str, default: Any = None) -> Any:
        mask = self._mask
        if mask == 0:
            self._mask = mask = _name_mask(self._raw, self._first, self._end)
        one = 1
        if type(key) is str:
            # The filter's bit from the name as given (a name any header can have is latin-1: a
            # byte per character): most names looked up are absent, and then need no bytes.
            text = key
            n = len(text)
            if n == 0 or not mask & (one << _bit(n, ord(text[n - 1]))):
                return default  # no name of this length and last letter
            lower = _KEY_BYTES.get(text)
            if lower is None:
                lower = _key_bytes(text)
        else:
            lower = _key_bytes(key)
            if lower is not None and not mask & (one << _name_bit(lower, 0, len(lower))):
                return default
        if lower is None:
            return default
        value = first_value(self._raw, self._first, self._end, lower)
        return default if value is None else value.decode("utf-8", "surrogateescape")

    def __getitem__(self, key: str) -> str:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return self.get(key, _MISSING) is not _MISSING  # type: ignore[arg-type]

    def _dict(self) -> dict[str, str]:
        out = self._decoded
        if out is None:
            self._decoded = out = decoded(self._raw, self._first, self._end)
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())

    def keys(self) -> KeysView[str]:
        return self._dict().keys()

    def items(self) -> ItemsView[str, str]:
        return self._dict().items()

    def values(self) -> ValuesView[str]:
        return self._dict().values()

    def __eq__(self, other: object) -> bool:
        return self._dict() == (dict(other) if isinstance(other, Mapping) else other)

    def __repr__(self) -> str:
        return f"HeaderBlock({self._dict()!r})"

    __hash__ = None  # type: ignore[assignment]  # like every Mapping


Mapping.register(HeaderBlock)


# The implementations, chosen once: compiled, the scans above run as C loops; interpreted, their
# bytes-method versions run instead.
_COMPILED = is_compiled(sys.modules[__name__])
if not _COMPILED:
    head_end = _head_end_py
    locate = _locate_py
    relay_block = _relay_block_py
    copy_block = _copy_block_py
    scan_request = _scan_request_py
    header_values = _header_values_py
    first_value = _first_value_py
    dot_segment = _dot_segment_py
    header_map = decoded
