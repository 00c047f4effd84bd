"""The id of an OpenAI Responses API response, read from the first bytes of its body.

For ``identity.body: [previous_response_id]`` the sidecar remembers which session produced each
response (:meth:`sidecar.state.SessionState.remember_response`); the id is in the response's
first bytes: a JSON body's top-level ``id`` (``{"id": "resp_...", "object": "response", ...}``),
or the ``response.id`` of a stream's first event (``response.created``). Engines hand the body's
beginning to :class:`FirstBytes` read by read, only for requests that asked for it, until it is
done: it found the id, or the id cannot come (another first event, a body that is not JSON), or
:data:`MAX_SCAN_BYTES` were read. Nothing here is on the path of any other response.

Pure and bounded: a chunked body's framing is taken off as far as it is complete, a JSON body is
walked from its start (strings and nesting tracked, nothing built) up to its top-level ``id``,
and an event's data is parsed only once whole and at most :data:`MAX_SCAN_BYTES` long.
"""

from __future__ import annotations

import orjson

from sidecar.headers import is_field_value

# The body bytes looked at, at most: an id comes first, or in the first event.
MAX_SCAN_BYTES = 16 * 1024
# A response id longer than this is no id the sidecar keeps.
MAX_RESPONSE_ID_CHARS = 256

_WS = b" \t\r\n"
# How a line of an event stream begins (a comment, or a field).
_SSE_FIELDS = (b":", b"event:", b"data:", b"id:", b"retry:")


class FirstBytes:
    """The beginning of one response body, gathered read by read until it names the response's
    id (``chunked``: the reads carry the body's chunked framing)."""

    __slots__ = ("chunked", "raw")

    def __init__(self, chunked: bool) -> None:
        self.chunked = chunked
        self.raw = b""

    def feed(self, data: bytes) -> tuple[bool, str | None]:
        """Add one read: (done, the id when found). Once done, feed no more."""
        raw = self.raw = self.raw + data[: MAX_SCAN_BYTES + 64 - len(self.raw)]
        payload, complete = dechunk(raw) if self.chunked else (raw, False)
        done, rid = response_id(payload[:MAX_SCAN_BYTES], complete)
        if rid is not None or done:
            return True, rid
        return len(raw) >= MAX_SCAN_BYTES, None


def dechunk(raw: bytes) -> tuple[bytes, bool]:
    """The data of the complete chunks at the start of a chunked body (extensions ignored), and
    whether the last chunk is among them."""
    out: list[bytes] = []
    pos = 0
    while True:
        line_end = raw.find(b"\r\n", pos)
        if line_end < 0:
            return b"".join(out), False
        size_text = raw[pos:line_end].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            return b"".join(out), True  # not chunked framing after all: nothing more to learn
        if size == 0:
            return b"".join(out), True
        start = line_end + 2
        if len(raw) < start + size:
            out.append(raw[start:])  # a partial chunk: its data so far
            return b"".join(out), False
        out.append(raw[start : start + size])
        pos = start + size + 2


def response_id(payload: bytes, complete: bool = False) -> tuple[bool, str | None]:
    """(done, id) for the beginning of a response body (``complete``: it is the whole body):
    a JSON object's top-level ``id``, or an event stream's first event's ``response.id``."""
    start = 0
    while start < len(payload) and payload[start] in _WS:
        start += 1
    if start == len(payload):
        return complete, None
    if payload[start] == 0x7B:  # "{": a JSON body
        return _top_level_id(payload, start, complete)
    head = payload[start : start + 6]
    if any(field.startswith(head) or head.startswith(field) for field in _SSE_FIELDS):
        return _first_event_id(payload, complete)
    return True, None  # neither a JSON object nor an event stream


def _checked(value: object) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= MAX_RESPONSE_ID_CHARS and is_field_value(value):
        return value
    return None


def _first_event_id(payload: bytes, complete: bool) -> tuple[bool, str | None]:
    """The ``response.id`` of the first event carrying data (comments and ``event:`` lines
    skipped); done without an id once that event is whole and names none."""
    text = payload.replace(b"\r\n", b"\n")
    end = text.find(b"\n\n")
    while end >= 0:
        event, text = text[:end], text[end + 2 :]
        data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            try:
                parsed = orjson.loads(b"\n".join(data))
            except orjson.JSONDecodeError:
                return True, None
            if not isinstance(parsed, dict):
                return True, None
            inner = parsed.get("response")
            if isinstance(inner, dict):
                return True, _checked(inner.get("id"))
            return True, _checked(parsed.get("id")) if parsed.get("object") == "response" else None
        end = text.find(b"\n\n")
    return complete, None


def _top_level_id(data: bytes, start: int, complete: bool) -> tuple[bool, str | None]:
    """Walk a JSON object from its ``{`` at ``start`` to its top-level member ``id``: the id
    when that member's value is a string, done without one once the value is something else or
    the object ended; not done while the bytes end first."""
    depth = 0
    pos = start
    n = len(data)
    expect_key = False  # at depth 1, the next string is a member name
    key: bytes | None = None
    while pos < n:
        c = data[pos]
        if c == 0x22:  # a string
            end = _string_end(data, pos)
            if end < 0:
                return complete, None
            if depth == 1:
                if expect_key:
                    key = data[pos + 1 : end]
                    expect_key = False
                elif key == b"id":
                    try:
                        value = orjson.loads(data[pos : end + 1])
                    except orjson.JSONDecodeError:
                        return True, None
                    return True, _checked(value)
            pos = end + 1
            continue
        if c == 0x7B or c == 0x5B:  # "{" or "["
            if depth == 1 and key == b"id":
                return True, None
            depth += 1
            if depth == 1:
                expect_key = True
        elif c == 0x7D or c == 0x5D:  # "}" or "]"
            depth -= 1
            if depth == 0:
                return True, None
        elif c == 0x2C and depth == 1:  # ","
            expect_key = True
            key = None
        elif c == 0x3A:  # ":"
            pass
        elif c not in _WS and depth == 1 and key == b"id":
            return True, None  # a number, true, false or null
        pos += 1
    return complete, None


def _string_end(data: bytes, pos: int) -> int:
    """The index of the quote that closes the string opening at ``pos`` (-1: not in ``data``)."""
    i = pos + 1
    while True:
        i = data.find(b'"', i)
        if i < 0:
            return -1
        backslashes = 0
        j = i - 1
        while data[j] == 0x5C:  # "\\"
            backslashes += 1
            j -= 1
        if backslashes % 2 == 0:
            return i
        i += 1
