"""Response bodies from an upstream connection to the client: the bytes passed through as they
arrive, their framing tracked here.

The upstream connection hands each read after the response head to the exchange's
:class:`BodyRelay` (``feed``), which finds where the body ends and writes the body's bytes to the
client's :class:`ClientOutput` in one write per read, without a Python call or an object per
chunk. How the body goes out depends on how it came and on the client (``mode``):

- ``LENGTH``: Content-Length bytes, passed through unchanged;
- ``CHUNKED``: chunked, to an HTTP/1.1 client: passed through unchanged (sizes, data and CRLFs
  as the upstream wrote them, so an event that arrives in one read leaves in one write), except
  chunk extensions and trailer fields, which are dropped (they are the upstream's hop);
- ``DECHUNK``: chunked, to an HTTP/1.0 client (a close-delimited answer): the chunks' data only;
- ``EOF_CHUNKED`` / ``EOF_RAW``: delimited by the upstream's close, re-framed as one chunk per
  read for an HTTP/1.1 client, passed through for an HTTP/1.0 one.

Chunked framing is checked as strictly as llhttp checks it (hex sizes below 2**60, CRLF after
sizes and data, no control characters in extensions, bounded trailers): malformed framing raises
:class:`~sidecar.engine.parse_errors.ParseError` before anything of that read is written, and the
exchange then aborts the client connection. Bytes after the end of the body are never relayed.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from sidecar.engine.parse_errors import ParseError

if TYPE_CHECKING:
    from typing import Protocol

    class Writer(Protocol):
        """What the connections write through (a :class:`~sidecar.engine.direct.DirectSocket`):
        ``fd`` is its socket."""

        @property
        def fd(self) -> int: ...

        def write(self, data: bytes) -> None: ...

        def has_input(self) -> bool:
            """Whether bytes, a close or an error wait to be read (peeked: nothing is taken)."""

        def writev(self, parts: list[bytes]) -> None:
            """``write(b"".join(parts))``, gathered by one ``sendmsg`` instead of joined."""

        def send_buffer(self, buf: bytes, n: int) -> None:
            """``write(buf[:n])`` where ``buf`` is a C buffer (compiled build: C callers only)."""


LENGTH, CHUNKED, DECHUNK, EOF_CHUNKED, EOF_RAW = range(5)
# The same modes for this module's own comparisons: the compiled build declares the private
# constants below as C longs (relay.pxd), so the per-event code compares machine integers; a
# constant declared that way is not importable, hence the public names above.
_LENGTH, _CHUNKED, _DECHUNK, _EOF_CHUNKED, _EOF_RAW = LENGTH, CHUNKED, DECHUNK, EOF_CHUNKED, EOF_RAW

# Chunked framing states.
_SIZE, _EXT, _SIZE_LF, _DATA, _DATA_CR, _DATA_LF, _TRAILER, _TRAILER_LINE, _TRAILER_LF, _END_LF, _DONE = range(11)
_MAX_DIGITS = 15  # hex digits of a chunk size (below 2**60, as llhttp)
_CR = 13
_LF = 10
_HTAB = 9
_DEL = 127
_LAST_CHUNK = b"0\r\n\r\n"


class ClientOutput:
    """The bytes a client connection has to write: gathered in ``parts`` while an event is
    handled, written in one write by :meth:`flush` (nothing once ``closed``): through ``sock``
    (:class:`sidecar.engine.direct.DirectSocket`, the compiled build; several parts in one
    gathering write) or the transport (joined)."""

    __slots__ = ("transport", "sock", "parts", "closed")

    def __init__(self, transport: asyncio.Transport, sock: Writer | None = None) -> None:
        self.transport = transport
        self.sock = sock
        self.parts: list[bytes] = []
        self.closed = False

    def flush(self) -> None:
        parts = self.parts
        if not parts:
            return
        if self.closed:
            parts.clear()
        elif len(parts) == 1:  # (the usual streamed event)
            data = parts[0]
            parts.clear()
            if self.sock is not None:
                self.sock.write(data)
            else:
                self.transport.write(data)
        elif self.sock is not None:  # a head and what follows it: gathered, not joined
            pieces = parts.copy()  # (emptied before the write, as a write may call back here)
            parts.clear()
            self.sock.writev(pieces)
        else:
            data = b"".join(parts)
            parts.clear()
            self.transport.write(data)

    def send_buffer(self, buf: bytes, n: int) -> None:
        """Write ``buf[:n]`` after what is gathered: at once when nothing is (through ``sock``,
        which makes a bytes object only for what the socket does not take), else gathered for
        the next flush. (Compiled build: ``buf`` is a C buffer, see
        :class:`~sidecar.engine.direct.DirectReads`.)"""
        if self.parts or self.sock is None:
            self.parts.append(buf[:n])
        elif not self.closed:
            self.sock.send_buffer(buf, n)


class BodyRelay:
    """One response body on its way to the client (see the module docstring).

    The upstream connection calls :meth:`feed` with every read until ``done``, and :meth:`eof`
    when the upstream closes; ``reads`` counts the reads (the exchange's idle timeout reads it
    instead of the clock)."""

    __slots__ = ("output", "mode", "left", "state", "digits", "budget", "reads", "done")

    def __init__(self, output: ClientOutput, mode: int, length: int, budget: int) -> None:
        self.output = output
        self.mode = mode
        self.left = length  # LENGTH: body bytes still to come; chunked: data bytes left in the chunk
        self.state = _SIZE
        self.digits = 0
        self.budget = budget  # trailer bytes still allowed (the response head limit)
        self.reads = 0
        self.done = mode == _LENGTH and length == 0

    def feed(self, data: bytes) -> int:
        """Relay the body's part of ``data`` (and flush the client's output); return how many
        bytes of ``data`` belong to the body: all of them unless it ends within ``data``
        (``done`` is then set). Raises ParseError on malformed chunked framing."""
        return self.feed_from(data, len(data), data)

    def feed_from(self, buf: bytes, n: int, data: bytes | None) -> int:
        """:meth:`feed` for the ``n`` bytes at ``buf``; ``data`` is the bytes object they are
        (from a transport's read), or None: then they are in a buffer that is reused after the
        call (the compiled build's :class:`~sidecar.engine.direct.DirectReads`), and a read
        that passes through whole is written to the client from there."""
        self.reads += 1
        mode = self.mode
        parts = self.output.parts
        if mode == _LENGTH:
            left = self.left
            if n < left:
                self.left = left - n
                self._whole(buf, n, data)
            else:
                parts.append(data if n == left and data is not None else buf[:left])
                self.left = 0
                self.done = True
                n = left
        elif mode == _CHUNKED or mode == _DECHUNK:
            n = self._chunks(buf, n, data, parts)
        elif mode == _EOF_CHUNKED:
            if n:
                parts += (b"%x\r\n" % n, buf[:n] if data is None else data, b"\r\n")
        else:
            self._whole(buf, n, data)
        if parts:
            self.output.flush()
        return n

    def end_sent(self) -> None:
        """The read that ends the body went to the client another way: the stream thread
        (:class:`~sidecar.engine.direct.DirectReads`) passed it through (whole chunks then the
        last chunk with no trailer, or the last bytes of a Content-Length body) and counted it in
        ``reads``. The relay is done."""
        self.left = 0
        if self.mode == _CHUNKED or self.mode == _DECHUNK:
            self.state = _DONE
        self.done = True

    def _whole(self, buf: bytes, n: int, data: bytes | None) -> None:
        """The whole read goes to the client as it came."""
        if data is None:
            self.output.send_buffer(buf, n)
        else:
            self.output.parts.append(data)

    def eof(self) -> bool:
        """The upstream closed: whether that ends the body (it does when the close delimits it);
        if so, the end goes to the client."""
        if self.mode == _EOF_CHUNKED:
            self.output.parts.append(_LAST_CHUNK)
        elif self.mode != _EOF_RAW:
            return False
        self.done = True
        self.output.flush()
        return True

    def _chunks(self, buf: bytes, n: int, data: bytes | None, parts: list[bytes]) -> int:
        """Track chunked framing through the ``n`` bytes at ``buf`` (``data``: as for
        :meth:`feed_from`), appending what goes to the client to ``parts``; return where the body
        ended (``n`` while it goes on)."""
        state = self.state
        left = self.left
        digits = self.digits
        through = self.mode == _CHUNKED
        pos = 0
        # Start of the run of bytes passed through as they are (-1: in a part that is dropped).
        seg = -1 if state == _EXT or state == _TRAILER or state == _TRAILER_LINE or state == _TRAILER_LF else 0
        out: list[bytes] | None = None  # pieces to pass on, other than the whole read (made when needed)
        while pos < n:
            c = buf[pos]
            if state == _DATA:
                take = n - pos
                if take > left:
                    take = left
                if not through:
                    if out is None:
                        out = []
                    out.append(buf[pos : pos + take])
                pos += take
                left -= take
                if left == 0:
                    if pos + 1 < n and buf[pos] == _CR and buf[pos + 1] == _LF:  # (the usual: both here)
                        state = _SIZE
                        digits = 0
                        pos += 2
                    else:
                        state = _DATA_CR
            elif state == _SIZE:
                if 48 <= c <= 57 or 65 <= c <= 70 or 97 <= c <= 102:  # HEXDIG: all of them that are here
                    while True:
                        if digits == _MAX_DIGITS:
                            raise ParseError("chunk size too large")
                        left = left * 16 + (c - 48 if c <= 57 else (c | 32) - 87)
                        digits += 1
                        pos += 1
                        if pos == n:
                            break
                        c = buf[pos]
                        if not (48 <= c <= 57 or 65 <= c <= 70 or 97 <= c <= 102):
                            break
                    if left and c == _CR and pos + 1 < n and buf[pos + 1] == _LF:  # (the usual: data follows)
                        state = _DATA
                        pos += 2
                elif digits == 0:
                    raise ParseError("invalid character in chunk size")
                elif c == _CR:
                    state = _SIZE_LF
                    pos += 1
                elif c == 59 or c == 32 or c == _HTAB:  # ';' or whitespace: extensions, dropped
                    if through and pos > seg >= 0:
                        if out is None:
                            out = []
                        out.append(buf[seg:pos])
                    seg = -1
                    state = _EXT
                    pos += 1
                else:
                    raise ParseError("invalid character in chunk size")
            elif state == _DATA_CR:
                if c != _CR:
                    raise ParseError("chunk data not followed by CRLF")
                state = _DATA_LF
                pos += 1
            elif state == _DATA_LF:
                if c != _LF:
                    raise ParseError("chunk data not followed by CRLF")
                state = _SIZE
                digits = 0
                pos += 1
            elif state == _SIZE_LF:
                if c != _LF:
                    raise ParseError("chunk size line not ended by CRLF")
                pos += 1
                if left:
                    state = _DATA
                else:  # the last chunk: its line goes through, trailer fields do not
                    state = _TRAILER
                    if through and seg >= 0:
                        if out is None:
                            out = []
                        out.append(buf[seg:pos])
                    seg = -1
            elif state == _EXT:
                if c == _CR:
                    seg = pos
                    state = _SIZE_LF
                elif (c < 32 and c != _HTAB) or c == _DEL:
                    raise ParseError("invalid character in chunk extension")
                pos += 1
            elif state == _TRAILER:  # at the start of a line after the last chunk
                if c == _CR:  # the empty line that ends the body: it goes through
                    seg = pos
                    state = _END_LF
                    pos += 1
                else:
                    state = _TRAILER_LINE
            elif state == _TRAILER_LINE:
                if c == _CR:
                    state = _TRAILER_LF
                elif c == _LF or (c < 32 and c != _HTAB) or c == _DEL:
                    raise ParseError("invalid character in trailer field")
                self.budget -= 1
                if self.budget < 0:
                    raise ParseError("trailer fields too large")
                pos += 1
            elif state == _TRAILER_LF:
                if c != _LF:
                    raise ParseError("trailer field not ended by CRLF")
                state = _TRAILER
                pos += 1
            else:  # _END_LF
                if c != _LF:
                    raise ParseError("chunked body not ended by CRLF")
                pos += 1
                state = _DONE
                break
        self.state = state
        self.left = left
        self.digits = digits
        if state == _DONE:
            self.done = True
        if through and seg == 0 and pos == n and out is None:
            self._whole(buf, n, data)  # the usual read: whole events, passed through as they came
            return n
        if out is not None:
            parts += out
        if through and 0 <= seg < pos:
            parts.append(buf[seg:pos])
        return pos
