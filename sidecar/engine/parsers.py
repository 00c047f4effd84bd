"""HTTP/1.1 parsing for the fast engine: llhttp (strict, no lenient flags) in both builds.

Both builds parse with llhttp at the version httptools vendors (``vendor/llhttp``), so they
accept and refuse the same bytes.

**Requests.** ``RequestParser(owner, max_head)`` is:

- compiled: :class:`sidecar.engine.llhttp_parser.LlhttpParser`, which drives llhttp with C
  callbacks and hands the owner the head as the raw bytes it arrived in (no Python call and no
  object per header);
- pure Python (no compiler, or ``SIDECAR_PURE_PYTHON=1``): :class:`HttptoolsParser` below, on
  httptools with a callback per header, which joins the header lines into a block of the same
  shape (``name ": " value CRLF`` per header, values as llhttp reports them).

The owner provides (called from inside :meth:`feed_data`, in stream order):

- ``on_head(raw, first, end, method, target, version, keep_alive, length)``: a request head is
  complete. ``raw[first:end]`` is its header block (the header lines, each ending in CRLF, see
  :mod:`sidecar.engine.head`); ``method`` and ``target`` are bytes; ``version`` is
  ``10 * major + minor``; ``keep_alive`` is llhttp's verdict; ``length`` the declared
  Content-Length (llhttp accepted exactly one, all digits), -1 without one.
- ``on_body(data)``: body bytes of the current request, de-chunked.
- ``on_message_complete()``: the current request ended (trailers are counted against the head
  limit and dropped).

:meth:`feed_data` raises :class:`HeadTooLarge` when a head (or the trailers) exceeds
``max_head`` bytes, even before its line ends; :class:`Http09Request` once a request line ended
without an HTTP version (or with version 0.9), without waiting for the rest of the head;
:class:`UpgradeRequest` after the head of an
upgrade or CONNECT request (nothing after it is parsed); :class:`ParseError` for bytes llhttp
refuses; :class:`CallbackError` when an owner callback raised (its exception is the cause).
After any of them the parser is unusable.

**Responses.** ``ResponseParser()`` (compiled: ``LlhttpResponseParser``; pure Python:
:class:`HttptoolsResponseParser`) reads response heads only: the engine finds each head's end
(its empty line) and relays the bodies itself. ``feed_head(data, start, stop)`` parses
``data[start:stop]`` (``0 <= start <= stop <= len(data)``, else ValueError; a span, so that the
read holding a head and a body's first bytes is not copied), the next bytes of the response
stream, never past a head's empty line, and returns the status code of the head they complete
(0 when they complete none: a head in pieces, or empty lines before a status line); the
next bytes are the next head, of a 1xx interim response's successor or of the next response on a
kept-alive connection. ``keep_alive`` is llhttp's verdict on the last completed head (HTTP
version, ``Connection``, and whether its body runs until the close), ``length`` its declared
Content-Length (llhttp accepted exactly one, all digits), -1 without one. ``feed_head`` raises
:class:`ParseError` for bytes llhttp refuses and for a protocol switch (the engine never asks for
one); the parser is then unusable.
"""

from __future__ import annotations

import re
from typing import Any

import httptools

from sidecar.engine.parse_errors import CallbackError, HeadTooLarge, Http09Request, ParseError, UpgradeRequest

__all__ = [
    "CallbackError",
    "HeadTooLarge",
    "Http09Request",
    "ParseError",
    "RequestParser",
    "ResponseParser",
    "UpgradeRequest",
]


_CONTENT_LENGTH = b"content-length"
# Bytes of the request stream kept between heads: a method cut into reads, and the byte before it.
_METHOD_TAIL = 32
_REASON_REFUSED = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


class HttptoolsParser:
    """The pure-Python build's request parser: httptools, with one callback per header."""

    __slots__ = (
        "parser",
        "on_head",
        "on_body",
        "on_message_complete",
        "max_head",
        "in_head",
        "target",
        "lines",
        "length",
        "size",
        "fed",
        "tail",
    )

    def __init__(self, owner: Any, max_head: int) -> None:
        self.on_head = owner.on_head
        # httptools looks its callbacks up once, here: the owner's are called directly.
        self.on_body = owner.on_body
        self.on_message_complete = owner.on_message_complete
        self.max_head = max_head
        self.in_head = False
        self.target = b""
        self.lines: list[bytes] = []
        self.length = -1  # the declared Content-Length (llhttp refuses a second one)
        self.size = 0  # head bytes so far as llhttp reported them (target, names, values, separators)
        self.fed = 0  # bytes fed since the read in which the head began
        self.tail = b""  # the last bytes of the stream (see _tail)
        self.parser = httptools.HttpRequestParser(self)

    def feed_data(self, data: bytes) -> None:
        if self.in_head:
            self.fed += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise UpgradeRequest from None
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, (HeadTooLarge, Http09Request)):
                raise type(cause)() from None
            raise CallbackError(str(exc)) from cause
        except httptools.HttpParserError as exc:
            raise ParseError(str(exc)) from None
        if self.in_head:
            if self.fed > self.max_head:
                raise HeadTooLarge()  # llhttp holds a partial header line until it ends: bound it
            self._check_version(data)
        else:
            self._tail(data, _METHOD_TAIL)  # (a method cut into reads: no target yet)

    def _check_version(self, data: bytes) -> None:
        """Raise :class:`Http09Request` when the head in progress has a request line that ended
        without a version, or with version 0.9. llhttp says 0.9 once a byte follows such a
        line; until then it only waits, and httptools reports no version callback: the line is
        found as the stream's last line, ``METHOD SP target``, which no header line can be."""
        parser = self.parser
        if parser.get_http_version() == "0.9":
            raise Http09Request()
        line = parser.get_method() + b" " + self.target
        tail = self._tail(data, len(line) + 3)
        ending = 2 if tail.endswith(b"\r\n") else 1 if tail.endswith(b"\n") else 0
        at = len(tail) - ending - len(line)
        if ending and at >= 0 and tail.startswith(line, at) and (at == 0 or tail[at - 1] == 10):
            raise Http09Request()

    def _tail(self, data: bytes, keep: int) -> bytes:
        """The last ``keep`` bytes of the request stream, ``data`` its latest read (kept: the
        bytes of a request line cut into reads). ``at == 0`` above is the stream's start: every
        read keeps enough for the line and the byte before it."""
        tail = self.tail = data[-keep:] if len(data) >= keep else (self.tail + data)[-keep:]
        return tail

    # No on_message_begin: a head begins with the first piece of its target (llhttp refuses an
    # empty one), which saves a callback per request.

    def on_url(self, url: bytes) -> None:
        if self.in_head:
            self.target += url
            self.size += len(url)
        else:
            self.in_head = True
            self.target = url
            self.lines = []
            self.length = -1
            self.size = len(url)
            self.fed = 0
        if self.size > self.max_head:
            raise HeadTooLarge()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.size += len(name) + len(value) + 4
        if self.size > self.max_head:
            raise HeadTooLarge()
        if self.in_head:
            self.lines.append(b"%s: %s\r\n" % (name, value))
            if len(name) == 14 and name.lower() == _CONTENT_LENGTH:
                self.length = int(value)
        # else: a trailer after a chunked body: counted against the limit, never forwarded

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.size = 0  # trailers get a budget of their own
        raw = b"".join(self.lines)
        parser = self.parser
        version = parser.get_http_version()
        if version == "0.9":
            raise Http09Request()
        major, _, minor = version.partition(".")
        self.on_head(
            raw,
            0,
            len(raw),
            parser.get_method(),
            self.target,
            int(major) * 10 + int(minor),
            parser.should_keep_alive(),
            self.length,
        )


class HttptoolsResponseParser:
    """The pure-Python build's response head parser: httptools, a new one after each head (its
    callback cannot tell llhttp that no body follows)."""

    __slots__ = ("parser", "status", "keep_alive", "length")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.keep_alive = False
        self.length = -1

    def feed_head(self, data: bytes, start: int, stop: int) -> int:
        if start < 0 or stop < start or stop > len(data):
            raise ValueError("feed_head: the span is outside the data")
        self.status = 0
        try:
            self.parser.feed_data(data[start:stop] if start or stop < len(data) else data)
        except httptools.HttpParserUpgrade:
            raise ParseError("the response switches protocols") from None
        except httptools.HttpParserError as exc:
            raise ParseError(str(exc)) from None
        if self.status:
            self.parser = httptools.HttpResponseParser(self)
        return self.status

    def on_message_begin(self) -> None:
        self.length = -1

    def on_status(self, reason: bytes) -> None:
        # relayed to the client as it is: HTAB, SP, visible ASCII or obs-text only (RFC 9112 4)
        if _REASON_REFUSED.search(reason) is not None:
            raise ParseError("invalid reason phrase")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 14 and name.lower() == _CONTENT_LENGTH:
            self.length = int(value)

    def on_headers_complete(self) -> None:
        parser = self.parser
        self.status = parser.get_status_code()
        if self.status < 100:  # no server sends one; 0 would read as "no head yet"
            raise ParseError("invalid status code")
        # Read now: once llhttp completes a message it clears the header flags this depends on.
        self.keep_alive = parser.should_keep_alive()


RequestParser: Any = HttptoolsParser
ResponseParser: Any = HttptoolsResponseParser
try:
    from sidecar.engine.llhttp_parser import LlhttpParser, LlhttpResponseParser
except ImportError:  # not compiled, or SIDECAR_PURE_PYTHON=1
    pass
else:
    RequestParser, ResponseParser = LlhttpParser, LlhttpResponseParser
