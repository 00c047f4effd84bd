"""Strict JSON (RFC 8259) scanning that locates values instead of building them.

:func:`scan` validates one JSON value and reports where things are: the value's span and, for
an object, the spans of the members whose keys the caller names. Nothing else is decoded, so a
scan holds O(depth + names) memory whatever the document contains (a body of a million empty
objects costs one pass over its bytes, not a million dicts), and nesting is bounded by
``max_depth``. :func:`elements` lists the first elements of an array already scanned.
:func:`assemble` builds the bytes of a document edited at spans a scan found, and :func:`join`
the bytes of a body that arrived in pieces: one copy each, which the compiled build makes
outside the GIL, so a large body handled on a worker thread holds up no other thread.

Strictness is RFC 8259's grammar over UTF-8: whitespace is space, tab, LF and CR only; no byte
order mark, comments, trailing commas, NaN/Infinity, leading zeros or unescaped control
characters; escapes are ``\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX``; the bytes must be valid UTF-8
(no overlong forms, no encoded surrogates). Two things orjson refuses are accepted because the
grammar allows them: numbers beyond a double's range (``1e400``; their bytes are never
converted) and ``\\u`` escapes of unpaired surrogates.

Two implementations, one contract: the compiled build's C scanner (``sidecar._jsonscan``, which
also releases the GIL over large inputs) and the pure-Python one here (one regular-expression
match per token). ``SIDECAR_PURE_PYTHON=1`` selects this one.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

# scan() statuses below 0 (>= 0: valid, the value's nesting depth).
INVALID = -1  # not one JSON value
TOO_DEEP = -2  # nested deeper than max_depth
TOO_MANY = -3  # more than MAX_HITS members matched the names
# Members a scan reports at most: keys a client repeats more often than this are refused rather
# than located one by one.
MAX_HITS = 64
# Nesting a scan accepts at most, whatever max_depth asks.
MAX_DEPTH = 1024
# Names one scan looks for at most.
MAX_NAMES = 16

# Bytes that may follow a backslash in a string, and the \\u escape's digits.
_STRING = re.compile(rb'"[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*"')
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_WS = re.compile(rb"[ \t\n\r]*")
_WS_BYTES = frozenset(b" \t\n\r")
# Control bytes (never raw in a string) -> 0, every other byte -> 1.
_CONTROLS = bytes(0 if b < 0x20 else 1 for b in range(256))

# Token kinds.
_STR, _SCALAR, _OPEN_OBJ, _OPEN_ARR, _CLOSE, _COMMA, _COLON_TOK = range(1, 8)
# What the next token may be.
_VALUE, _FIRST_ITEM, _FIRST_KEY, _KEY, _COLON, _AFTER = range(6)
# Literals by first byte.
_LITERALS = {ord("t"): b"true", ord("f"): b"false", ord("n"): b"null"}


def scan(
    data: bytes, start: int, end: int, max_depth: int, names: tuple[bytes, ...] = ()
) -> tuple[int, int, int, int, list[int]]:
    """Validate the JSON value in ``data[start:end]`` (whitespace around it allowed).

    Returns ``(status, value_start, value_end, last, hits)``. ``status`` is the value's depth
    (0 for a scalar, 1 for ``[]`` or ``{"a": 1}``, ...) when valid, else :data:`INVALID`,
    :data:`TOO_DEEP` or :data:`TOO_MANY` (the other fields are then meaningless). For a
    container, ``last`` is where its last member or element ends (right after the opening
    bracket when it is empty). When the value is an object, ``hits`` holds five numbers for each
    of its members whose key (escapes decoded, as UTF-8) equals one of ``names`` (at most
    :data:`MAX_NAMES`), in document order: the name's index, the key's start and end (quotes included), the
    value's start and end.
    """
    if len(names) > MAX_NAMES:
        raise ValueError(f"at most {MAX_NAMES} names")
    return _walk(data, start, end, min(max_depth, MAX_DEPTH), names, 0)


def elements(data: bytes, start: int, end: int, limit: int) -> list[int]:
    """Start and end of each of the first ``limit`` (at most :data:`MAX_HITS`) elements of the
    array at ``data[start:end]``, a span :func:`scan` found valid (the rest is not read)."""
    return _walk(data, start, end, MAX_DEPTH, (), min(limit, MAX_HITS))[4] if limit > 0 else []


def assemble(data: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    """``data`` with each ``(start, end, replacement)`` of ``edits`` (sorted, not overlapping)
    applied: ``data[start:end]`` replaced by ``replacement``."""
    view = memoryview(data)
    pieces: list[bytes | memoryview] = []
    pos = 0
    for start, end, replacement in edits:
        if start < pos or end < start:
            raise ValueError("edits must be sorted and not overlap")
        pieces += (view[pos:start], replacement)
        pos = end
    pieces.append(view[pos:])
    return b"".join(pieces)


def join(chunks: list[bytes]) -> bytes:
    """The concatenation of ``chunks``."""
    return b"".join(chunks)


def members_json(values: dict[str, Any]) -> bytes:
    """The members of the JSON object ``values`` serializes to, without its braces: exactly
    ``orjson.dumps(values)[1:-1]``, with its errors (``TypeError`` for a key that is not a string
    or a value it cannot serialize)."""
    serialized = orjson.dumps(values)
    return serialized[1:-1]


def _walk(
    data: bytes, start: int, end: int, max_depth: int, names: tuple[bytes, ...], limit: int
) -> tuple[int, int, int, int, list[int]]:
    """The scanner: a token at a time, dispatched on its first byte, with a stack of the open
    containers. ``limit > 0``: list that many elements of the (valid) array, then stop."""
    if not limit:
        span = data if start == 0 and end == len(data) else data[start:end]
        if not span.isascii():
            try:
                span.decode()  # strict UTF-8: no overlong forms, no surrogates
            except UnicodeDecodeError:
                return INVALID, 0, 0, 0, []
    controls = b""  # data[start:end] mapped through _CONTROLS, made at the first string
    find = data.find
    wanted = {name: i for i, name in enumerate(names)}
    hits: list[int] = []
    stack: list[bool] = []  # the open containers, True for an object
    depth = deepest = 0
    state = _VALUE
    pos = start
    vstart = vend = last = 0  # the scanned value's span, the end of its last item
    member = -1  # the name index of the top-level member being read; -1: not a wanted one
    ks = ke = vs = 0  # its key's span and its value's start
    while pos < end:
        c = data[pos]
        if c in _WS_BYTES:
            pos = _WS.match(data, pos, end).end()  # type: ignore[union-attr]
            if pos == end:
                break
            c = data[pos]
        tok = pos
        # The token: its kind, and pos moves past it.
        if c == 34:  # "
            close = find(b'"', pos + 1, end)
            if close < 0:
                return INVALID, 0, 0, 0, []
            if find(b"\\", pos + 1, close) < 0:
                if not controls:
                    controls = data[start:end].translate(_CONTROLS)
                if controls.find(0, pos + 1 - start, close - start) >= 0:
                    return INVALID, 0, 0, 0, []
                pos = close + 1
            else:  # escapes: the full grammar
                m = _STRING.match(data, pos, end)
                if m is None:
                    return INVALID, 0, 0, 0, []
                pos = m.end()
            kind = _STR
        elif c == 123 or c == 91:  # { [
            kind = _OPEN_OBJ if c == 123 else _OPEN_ARR
            pos += 1
        elif c == 125 or c == 93:  # } ]
            kind = _CLOSE
            pos += 1
        elif c == 44:  # ,
            kind = _COMMA
            pos += 1
        elif c == 58:  # :
            kind = _COLON_TOK
            pos += 1
        elif c == 45 or 48 <= c <= 57:  # - 0-9
            m = _NUMBER.match(data, pos, end)
            if m is None:
                return INVALID, 0, 0, 0, []
            pos = m.end()
            kind = _SCALAR
        else:
            literal = _LITERALS.get(c)
            if literal is None or not data.startswith(literal, pos, end):
                return INVALID, 0, 0, 0, []
            pos += len(literal)
            kind = _SCALAR
        if state == _AFTER:
            if kind == _COMMA:
                if not depth:
                    return INVALID, 0, 0, 0, []
                state = _KEY if stack[-1] else _VALUE
                continue
            # Only the bracket that closes the innermost container.
            if kind != _CLOSE or not depth or stack[-1] != (c == 125):
                return INVALID, 0, 0, 0, []
            stack.pop()
            depth -= 1
        elif state == _COLON:
            if kind != _COLON_TOK:
                return INVALID, 0, 0, 0, []
            state = _VALUE
            continue
        elif state >= _FIRST_KEY:
            if kind == _STR:
                if depth == 1:
                    ks = tok
                    ke = pos
                    member = -1
                    if wanted:
                        key = data[tok + 1 : pos - 1]
                        if 92 in key:  # escaped: compare the decoded key
                            try:
                                key = orjson.loads(data[tok:pos]).encode()
                            except (orjson.JSONDecodeError, UnicodeEncodeError):
                                key = b""  # an unpaired surrogate matches no name
                        member = wanted.get(key, -1)
                state = _COLON
                continue
            if kind != _CLOSE or state != _FIRST_KEY or c != 125:  # {}
                return INVALID, 0, 0, 0, []
            stack.pop()
            depth -= 1
        elif kind == _CLOSE and state == _FIRST_ITEM and c == 93:  # []
            stack.pop()
            depth -= 1
        else:  # a value starts
            if depth == 1:
                vs = tok
            elif not depth:
                vstart = tok
                last = pos
            if kind != _STR and kind != _SCALAR:
                if kind != _OPEN_OBJ and kind != _OPEN_ARR:
                    return INVALID, 0, 0, 0, []
                depth += 1
                if depth > deepest:
                    deepest = depth
                    if depth > max_depth:
                        return TOO_DEEP, 0, 0, 0, []
                stack.append(kind == _OPEN_OBJ)
                state = _FIRST_KEY if kind == _OPEN_OBJ else _FIRST_ITEM
                continue
        # A value ended at pos: a scalar, or a container closed.
        state = _AFTER
        if depth == 1:
            last = pos
            if member >= 0:
                if len(hits) == 5 * MAX_HITS:
                    return TOO_MANY, 0, 0, 0, []
                hits += (member, ks, ke, vs, pos)
                member = -1
            elif limit and not stack[0]:
                hits += (vs, pos)
                if len(hits) == 2 * limit:
                    return deepest, start, end, last, hits
        elif not depth:
            vend = pos
    if state != _AFTER or depth:
        return INVALID, 0, 0, 0, []
    return deepest, vstart, vend, last, hits


# The pure-Python implementations, whichever build runs (the tests hold the two to one contract).
scan_py = scan
elements_py = elements
assemble_py = assemble
join_py = join
members_json_py = members_json

try:  # the compiled build's C scanner
    from sidecar._jsonscan import assemble, elements, join, members_json, scan  # type: ignore[no-redef]  # noqa: F811

    COMPILED = True
except ImportError:
    COMPILED = False

# Bodies up to this size are scanned where they arrive, on the event loop; larger ones on a
# worker thread. The bound keeps the loop's worst case (the densest JSON, a token per byte or
# two) within a millisecond or two: the C scanner reads such bytes at hundreds of MB/s, the
# pure-Python one spends about a microsecond per token.
INLINE_BYTES = 256 * 1024 if COMPILED else 2 * 1024
