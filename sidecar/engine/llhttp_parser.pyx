# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled build's parsers: the vendored llhttp (strict, no lenient flags) driven with C
callbacks. The contracts are in :mod:`sidecar.engine.parsers`.

For requests, the callbacks only note where things are: where the head in progress began
(``on_method``), its target, and the trailer bytes. When llhttp completes a head, the head is
handed to the owner as the bytes it arrived in, with :func:`sidecar.engine.head.locate`'s
offsets: no copy when it arrived in one read (the usual case; ``raw`` is then that read), one
join of its reads otherwise. So a request costs the owner three Python calls (head, body, end)
whatever its header count. Responses are parsed head by head, with no Python call back: the
engine relays their bodies itself, so after each head llhttp is told there is no body and goes on
to the next head. A response head of the plainest form (``HTTP/1.1``, a length or chunked, no
header llhttp gives meaning to but those) is read in one C pass instead, with the same outcome
(:func:`_plain_head`): it is on the latency path, and most responses are of that form.

Request bodies with a Transfer-Encoding are decoded here, not by llhttp (:class:`_Chunked`): llhttp
refuses the whitespace RFC 9112 7.1.1 allows around ``;`` and ``=`` in chunk extensions and around
the Transfer-Encoding value. The head callback tells llhttp to skip such a body, the message-complete
callback then pauses llhttp, and this module decodes the chunks and resumes llhttp at the next
request. The engine re-frames every body it forwards, so its reading of the chunks is the only one
the upstream sees.
"""

import re

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint8_t, uint16_t, uint64_t
from libc.string cimport memcmp

from sidecar.engine.head cimport locate

from sidecar.engine.parse_errors import CallbackError, HeadTooLarge, Http09Request, ParseError, UpgradeRequest

# RFC 9112 7.1.1 chunk extensions (after the size), bad whitespace included; RFC 9112 7.1.2 trailer
# field lines. Both are checked only when present.
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_QUOTED = rb'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"'
_CHUNK_EXT = re.compile(rb"(?:[ \t]*;[ \t]*" + _TOKEN + rb"(?:[ \t]*=[ \t]*(?:" + _TOKEN + rb"|" + _QUOTED +
                        rb"))?)*[ \t]*")
_TRAILER = re.compile(_TOKEN + rb":[\t \x21-\x7e\x80-\xff]*")
_MAX_SIZE_LINE = 4096  # a chunk-size line, extensions included
_MAX_SIZE_DIGITS = 15  # hex digits of a chunk size (below 2**60)


cdef extern from "llhttp.h":
    ctypedef enum llhttp_type_t:
        HTTP_REQUEST
        HTTP_RESPONSE
    ctypedef enum llhttp_errno_t:
        HPE_OK
        HPE_PAUSED
        HPE_PAUSED_UPGRADE
        HPE_USER
    ctypedef enum llhttp_flags:
        F_CONTENT_LENGTH
        F_TRANSFER_ENCODING
    ctypedef enum llhttp_method_t:
        pass
    ctypedef struct llhttp_t:
        uint64_t content_length
        uint8_t method
        uint8_t http_major
        uint8_t http_minor
        uint8_t upgrade
        uint16_t flags
        uint16_t status_code
        void* data
    ctypedef int (*llhttp_data_cb)(llhttp_t*, const char*, size_t) noexcept
    ctypedef int (*llhttp_cb)(llhttp_t*) noexcept
    ctypedef struct llhttp_settings_t:
        llhttp_data_cb on_method
        llhttp_data_cb on_url
        llhttp_data_cb on_header_field
        llhttp_data_cb on_header_value
        llhttp_data_cb on_protocol
        llhttp_cb on_protocol_complete
        llhttp_data_cb on_status
        llhttp_cb on_headers_complete
        llhttp_data_cb on_body
        llhttp_cb on_message_complete
    void llhttp_settings_init(llhttp_settings_t* settings)
    void llhttp_init(llhttp_t* parser, llhttp_type_t type, const llhttp_settings_t* settings)
    llhttp_errno_t llhttp_execute(llhttp_t* parser, const char* data, size_t len)
    int llhttp_should_keep_alive(const llhttp_t* parser)
    void llhttp_resume_after_upgrade(llhttp_t* parser)
    void llhttp_resume(llhttp_t* parser)
    const char* llhttp_get_error_reason(const llhttp_t* parser)
    const char* llhttp_get_error_pos(const llhttp_t* parser)
    const char* llhttp_method_name(llhttp_method_t method)


# _Chunked states
cdef enum:
    SIZE = 0  # chunk-size digits
    SIZE_LINE = 1  # the rest of the size line (extensions) up to CRLF
    DATA = 2  # chunk data
    DATA_CR = 3  # the CRLF after chunk data
    DATA_LF = 4
    TRAILER = 5  # trailer field lines up to an empty line
    DONE = 6

cdef class _Chunked

cdef llhttp_settings_t _REQUEST_SETTINGS
cdef llhttp_settings_t _RESPONSE_SETTINGS
# Method names as bytes, by llhttp's method number (filled as methods are seen).
cdef list _METHODS = [None] * 256


cdef class _Llhttp:
    """What both directions share: the parser, error reporting."""

    cdef llhttp_t p
    cdef object error  # what a callback raised, re-raised once llhttp returns
    cdef bytes data  # the read being parsed (during feed_data)
    cdef const char* buf  # its bytes
    cdef bint own_body  # the message's body is decoded by this module: pause llhttp at its end
    cdef Py_ssize_t paused_at  # where llhttp paused in the last _execute's data
    cdef Py_ssize_t protocol  # bytes of the message's protocol name seen so far (see _on_protocol)

    cdef int _init(self, llhttp_type_t kind, llhttp_settings_t* settings) except -1:
        llhttp_init(&self.p, kind, settings)
        self.p.data = <void*>self
        return 0

    cdef int head(self) except -1:
        """llhttp completed a head: hand it to the owner (per direction)."""
        return 0

    cdef llhttp_errno_t _execute(self, data) except? HPE_USER:
        """Run llhttp over ``data``; raise what failed (a protocol switch is left to the caller)."""
        if type(data) is not bytes:
            data = bytes(data)
        return self._execute_at(data, 0, len(data))

    cdef llhttp_errno_t _execute_at(self, bytes data, Py_ssize_t start, Py_ssize_t stop) except? HPE_USER:
        """:meth:`_execute` over ``data[start:stop]`` (``0 <= start <= stop <= len(data)``)."""
        cdef llhttp_errno_t err
        self.data = data
        self.buf = PyBytes_AS_STRING(data)
        err = llhttp_execute(&self.p, self.buf + start, stop - start)
        self.data = None
        if err == HPE_OK or (err == HPE_PAUSED_UPGRADE and self.p.upgrade):
            return err
        if err == HPE_PAUSED and self.own_body and self.error is None:
            self.paused_at = llhttp_get_error_pos(&self.p) - self.buf
            return err
        error = self.error
        if error is None:
            raise ParseError(llhttp_get_error_reason(&self.p).decode("latin-1"))
        self.error = None
        if isinstance(error, ParseError) and not isinstance(error, CallbackError):
            raise error  # a callback refused the message itself (its head is too large, its status invalid)
        raise CallbackError(llhttp_get_error_reason(&self.p).decode("latin-1")) from error


cdef class LlhttpParser(_Llhttp):
    """Requests (see :mod:`sidecar.engine.parsers`)."""

    cdef object on_head, on_body, on_complete
    cdef Py_ssize_t max_head
    cdef list pieces  # earlier reads holding the head in progress, from its first byte
    cdef Py_ssize_t held  # their size
    cdef Py_ssize_t start  # where the head in progress starts in data (-1: in an earlier read)
    cdef public bint in_head  # a request head is in progress (the engine times it)
    cdef bytes target
    cdef Py_ssize_t trailer  # trailer bytes of the current request
    cdef _Chunked chunks  # the body being decoded here (own_body), else None

    def __init__(self, owner, Py_ssize_t max_head):
        self._init(HTTP_REQUEST, &_REQUEST_SETTINGS)
        self.on_head = owner.on_head
        self.on_body = owner.on_body
        self.on_complete = owner.on_message_complete
        self.max_head = max_head
        self.pieces = []
        self.target = b""
        self.chunks = None

    def feed_data(self, data):
        cdef Py_ssize_t size, pos = 0
        cdef llhttp_errno_t err
        if type(data) is not bytes:
            data = bytes(data)
        while True:
            if self.chunks is not None:  # a body decoded here: its bytes first
                pos = self.chunks.feed(data, pos)
                if not self.chunks.done:
                    return
                self.chunks = None
                self.own_body = False
                try:
                    self.on_complete()
                except BaseException as exc:
                    raise CallbackError("on_message_complete failed") from exc
                llhttp_resume(&self.p)
                if pos >= len(data):
                    return
                data = data[pos:]
                pos = 0
            err = self._execute(data)
            if err == HPE_PAUSED_UPGRADE:
                llhttp_resume_after_upgrade(&self.p)
                raise UpgradeRequest()
            if err != HPE_PAUSED:
                break
            pos = self.paused_at  # the head of a body decoded here ended there
        if self.in_head:  # the head continues in the next read: keep its bytes so far
            if self.p.http_major == 0 and self.p.http_minor == 9:  # (a request line saying HTTP/0.9)
                raise Http09Request()
            if self.start > 0:
                data = data[self.start:]
            size = self.held + len(data)
            if size > self.max_head:  # llhttp holds a partial header line until it ends: bound it
                raise HeadTooLarge()
            self.pieces.append(data)
            self.held = size
            self.start = -1

    cdef int head(self) except -1:
        cdef bytes raw
        cdef Py_ssize_t start, first, end
        cdef object length  # a Python int, not inferred as a C integer: llhttp admits any uint64
        cdef llhttp_t* p = &self.p
        self.in_head = False
        if self.held:
            # The head began in an earlier read; it ends within max_head bytes of this one
            # (or is too large).
            self.pieces.append(self.data[:self.max_head + 4])
            raw = b"".join(self.pieces)
            self.pieces.clear()
            self.held = 0
            start = 0
        else:
            raw = self.data
            start = self.start
        start, first, end = locate(raw, start)
        if end + 2 - start > self.max_head:
            raise HeadTooLarge()
        if p.http_major == 0 and p.http_minor == 9:  # (a request line saying HTTP/0.9)
            raise Http09Request()
        method = _METHODS[p.method]
        if method is None:
            method = _METHODS[p.method] = <bytes>llhttp_method_name(<llhttp_method_t>p.method)
        target = self.target
        self.target = b""
        length = -1
        if p.flags & F_CONTENT_LENGTH:
            length = p.content_length
        self.on_head(raw, first, end, method, target, p.http_major * 10 + p.http_minor,
                     llhttp_should_keep_alive(p) != 0, length)
        if p.flags & F_TRANSFER_ENCODING and not p.upgrade:
            # Decoded here (see the module docstring): llhttp skips it and pauses at its end.
            self.own_body = True
            self.chunks = _Chunked(self.on_body, self.max_head)
            return 1
        return 0


cdef class _Chunked:
    """Decodes one chunked request body (RFC 9112 7.1), whitespace in extensions allowed,
    extensions and trailers checked and dropped. Trailers count against ``budget`` bytes."""

    cdef object on_body
    cdef int state
    cdef unsigned long long left  # data bytes left in the current chunk
    cdef int digits
    cdef bytearray line  # the size line (after the digits) or trailer line in progress
    cdef Py_ssize_t budget
    cdef readonly bint done

    def __init__(self, on_body, Py_ssize_t budget):
        self.on_body = on_body
        self.state = SIZE
        self.line = bytearray()
        self.budget = budget

    cdef Py_ssize_t feed(self, bytes data, Py_ssize_t pos) except -1:
        """Decode from ``data[pos:]``; return where this body ends in ``data`` (``len(data)``
        when it continues in the next read)."""
        cdef const unsigned char* b = <const unsigned char*>PyBytes_AS_STRING(data)
        cdef Py_ssize_t n = len(data), take, eol
        cdef unsigned char c
        while pos < n and self.state != DONE:
            c = b[pos]
            if self.state == SIZE:
                if 48 <= c <= 57 or 65 <= c <= 70 or 97 <= c <= 102:  # HEXDIG
                    if self.digits == _MAX_SIZE_DIGITS:
                        raise ParseError("chunk size too large")
                    self.left = self.left * 16 + (c - 48 if c <= 57 else (c | 32) - 87)
                    self.digits += 1
                    pos += 1
                    continue
                if self.digits == 0:
                    raise ParseError("invalid character in chunk size")
                self.state = SIZE_LINE
            elif self.state == SIZE_LINE or self.state == TRAILER:
                eol = pos
                while eol < n and b[eol] != 10:
                    eol += 1
                self.line += data[pos:eol]
                if self.state == TRAILER and len(self.line) > self.budget:
                    raise HeadTooLarge()  # trailers count against the head limit, as llhttp's did
                if len(self.line) > _MAX_SIZE_LINE and self.state == SIZE_LINE:
                    raise ParseError("chunk size line too long")
                if eol == n:
                    return n
                pos = eol + 1
                self._line_done()
            elif self.state == DATA:
                take = n - pos
                if <unsigned long long>take > self.left:
                    take = <Py_ssize_t>self.left
                self.left -= take
                try:
                    self.on_body(data[pos:pos + take])
                except BaseException as exc:
                    raise CallbackError("on_body failed") from exc
                pos += take
                if self.left == 0:
                    self.state = DATA_CR
            elif self.state == DATA_CR:
                if c != 13:
                    raise ParseError("chunk data not followed by CRLF")
                self.state = DATA_LF
                pos += 1
            else:  # DATA_LF
                if c != 10:
                    raise ParseError("chunk data not followed by CRLF")
                self.state = SIZE
                self.digits = 0
                pos += 1
        return pos

    cdef int _line_done(self) except -1:
        """A size line's rest or a trailer line ended with LF (``line`` holds it without)."""
        cdef bytes line = bytes(self.line)
        self.line.clear()
        if not line.endswith(b"\r"):
            raise ParseError("line not ended by CRLF")
        line = line[: len(line) - 1]  # (no negative index: this module is compiled without wraparound)
        if self.state == SIZE_LINE:
            if _CHUNK_EXT.fullmatch(line) is None:
                raise ParseError("invalid chunk extension")
            self.state = DATA if self.left else TRAILER
            if self.left == 0:
                self.digits = 0
            return 0
        if not line:
            self.state = DONE
            self.done = True
            return 0
        self.budget -= len(line) + 2
        if self.budget < 0:
            raise HeadTooLarge()
        if _TRAILER.fullmatch(line) is None:
            raise ParseError("invalid trailer field")
        return 0


cdef class LlhttpResponseParser(_Llhttp):
    """Response heads (see :mod:`sidecar.engine.parsers`).

    A head of the plainest form is read by :func:`_plain_head`, one pass in C, instead of llhttp:
    most responses are of that form, and they are read on the latency path (the response's
    bytes wait for it). Any other head goes to llhttp, and so does everything after a span that
    completed no head or a head after which the connection is not kept (llhttp then refuses more
    bytes)."""

    cdef int status  # of the head completed in the bytes being fed (0: none yet)
    cdef readonly bint keep_alive
    cdef readonly object length  # a Python int: llhttp admits any uint64
    cdef bint to_llhttp  # llhttp holds part of a head, or the connection ended its reuse

    def __init__(self):
        self._init(HTTP_RESPONSE, &_RESPONSE_SETTINGS)
        self.length = -1

    cdef int head(self) except -1:
        if self.p.status_code < 100:  # no server sends one; 0 would read as "no head yet"
            raise ParseError("invalid status code")
        self.status = self.p.status_code
        # Read now: once llhttp completes a message it clears the header flags this depends on.
        self.keep_alive = llhttp_should_keep_alive(&self.p) != 0
        self.length = self.p.content_length if self.p.flags & F_CONTENT_LENGTH else -1
        return 1  # no body here: llhttp goes on to the next head

    def feed_head(self, bytes data not None, Py_ssize_t start, Py_ssize_t stop):
        if start < 0 or stop < start or stop > len(data):
            raise ValueError("feed_head: the span is outside the data")
        self.status = 0
        if not self.to_llhttp and _plain_head(self, PyBytes_AS_STRING(data) + start, stop - start):
            return self.status
        return self._llhttp_head(data, start, stop)

    def llhttp_head(self, bytes data not None, Py_ssize_t start, Py_ssize_t stop):
        """:meth:`feed_head` by llhttp alone: the reference :func:`_plain_head` is tested against."""
        if start < 0 or stop < start or stop > len(data):
            raise ValueError("llhttp_head: the span is outside the data")
        self.status = 0
        return self._llhttp_head(data, start, stop)

    cdef int _llhttp_head(self, bytes data, Py_ssize_t start, Py_ssize_t stop) except -1:
        """llhttp over the checked span (``status`` reset): a C call from :meth:`feed_head`."""
        if self._execute_at(data, start, stop) == HPE_PAUSED_UPGRADE:
            raise ParseError("the response switches protocols")
        self.to_llhttp = self.status == 0 or not self.keep_alive
        return self.status


def plain_head(bytes data not None):
    """``(status, keep_alive, length)`` when :func:`_plain_head` reads ``data`` (one whole head),
    else None: for tests."""
    cdef LlhttpResponseParser parser = LlhttpResponseParser()
    if _plain_head(parser, PyBytes_AS_STRING(data), len(data)):
        return parser.status, parser.keep_alive, parser.length
    return None


# Byte classes of _plain_head: a token character (RFC 9110 5.6.2), a character of a reason
# phrase or field value it takes (HTAB, SP, visible ASCII; obs-text and the rest go to llhttp).
cdef enum:
    _TCHAR = 1
    _VCHAR = 2
cdef unsigned char _CLASSES[256]


cdef void _fill_classes() noexcept:
    cdef int c
    for c in range(256):
        _CLASSES[c] = 0
        if c == 9 or 32 <= c <= 126:
            _CLASSES[c] = _VCHAR
        if (48 <= c <= 57) or (65 <= c <= 90) or (97 <= c <= 122) or c in b"!#$%&'*+-.^_`|~":
            _CLASSES[c] |= _TCHAR


_fill_classes()


cdef bint _same(const unsigned char* s, const char* lower, Py_ssize_t n) noexcept:
    """``s[:n]`` is ``lower`` (lower-case ASCII) but for the case of letters."""
    cdef Py_ssize_t k
    cdef unsigned char c
    for k in range(n):
        c = s[k]
        if 65 <= c <= 90:
            c += 32
        if c != <unsigned char>lower[k]:
            return False
    return True


cdef bint _plain_head(LlhttpResponseParser self, const char* at, Py_ssize_t n) except -1:
    """Read ``at[:n]`` when it is exactly one response head of the plainest form and set
    ``status``, ``keep_alive`` and ``length`` as llhttp would; return whether it did (False:
    llhttp must read it, whether it is valid or not). The form: an ``HTTP/1.1`` status line
    with a status of 200-599 other than 204 and 304 and a reason of HTAB, SP and visible ASCII;
    header lines ``token ":" OWS value CRLF`` with such values; at most one Content-Length (1-18
    digits, nothing else) or one ``Transfer-Encoding: chunked``, not both; at most one
    ``Connection: keep-alive``; no Proxy-Connection and no Upgrade (llhttp gives them meaning);
    a length or chunked (a body that runs until the close ends the connection's reuse, which
    llhttp must know to refuse what follows). A subset of what llhttp (strict) accepts, read the
    same way: tests/engine/test_parsers.py checks both on generated and altered heads."""
    cdef const unsigned char* s = <const unsigned char*>at
    cdef Py_ssize_t i, name, nlen, v, vend
    cdef long long length = -1
    cdef bint chunked = False, connection = False
    cdef int status
    if n < 17 or s[n - 4] != 13 or s[n - 3] != 10 or s[n - 2] != 13 or s[n - 1] != 10:
        return False
    if memcmp(s, b"HTTP/1.1 ", 9) != 0:
        return False
    if not (50 <= s[9] <= 53 and 48 <= s[10] <= 57 and 48 <= s[11] <= 57 and s[12] == 32):
        return False
    status = (s[9] - 48) * 100 + (s[10] - 48) * 10 + (s[11] - 48)
    if status == 204 or status == 304:
        return False
    i = 13
    while _CLASSES[s[i]] & _VCHAR:  # (the CRLF CRLF at the end stops every scan)
        i += 1
    if s[i] != 13 or s[i + 1] != 10:
        return False
    i += 2
    while i < n - 2:  # a header line; the blank line is at n - 2
        name = i
        while _CLASSES[s[i]] & _TCHAR:
            i += 1
        nlen = i - name
        if nlen == 0 or s[i] != 58:  # ":"
            return False
        i += 1
        while s[i] == 32 or s[i] == 9:
            i += 1
        v = i
        while _CLASSES[s[i]] & _VCHAR:
            i += 1
        if s[i] != 13 or s[i + 1] != 10:
            return False
        vend = i
        i += 2
        if nlen == 14 and _same(s + name, b"content-length", 14):
            if length >= 0 or chunked or vend == v or vend - v > 18:
                return False
            length = 0
            while v < vend:
                if not 48 <= s[v] <= 57:
                    return False
                length = length * 10 + (s[v] - 48)
                v += 1
        elif nlen == 17 and _same(s + name, b"transfer-encoding", 17):
            if chunked or length >= 0 or vend - v != 7 or not _same(s + v, b"chunked", 7):
                return False
            chunked = True
        elif nlen == 10 and _same(s + name, b"connection", 10):
            if connection or vend - v != 10 or not _same(s + v, b"keep-alive", 10):
                return False
            connection = True
        elif (nlen == 16 and _same(s + name, b"proxy-connection", 16)) or (nlen == 7 and _same(s + name, b"upgrade", 7)):
            return False
    if i != n - 2:
        return False
    if length < 0 and not chunked:
        return False
    self.status = status
    self.length = length
    self.keep_alive = True  # HTTP/1.1, no Connection: close, a body that does not run until the close
    return True


cdef inline _Llhttp _parser(llhttp_t* p):
    return <_Llhttp>p.data


cdef int _fail(_Llhttp self, exc) noexcept:
    self.error = exc
    return HPE_USER


cdef int _on_method(llhttp_t* p, const char* at, size_t length) noexcept:
    cdef LlhttpParser self = <LlhttpParser>p.data
    if not self.in_head:  # the first piece of a new request (llhttp skipped any CR/LF before it)
        self.in_head = True
        self.start = at - self.buf
        self.trailer = 0
    return 0


cdef int _on_url(llhttp_t* p, const char* at, size_t length) noexcept:
    """A piece of the request target. The one that ends at a line's end ends a request line
    without an HTTP version: refused now (llhttp would read header lines until an empty line
    that an HTTP/0.9 client never sends)."""
    cdef LlhttpParser self = <LlhttpParser>p.data
    cdef const char* after = at + length
    try:
        piece = PyBytes_FromStringAndSize(at, length)
        self.target = piece if not self.target else self.target + piece
        if after < self.buf + len(self.data) and (after[0] == 13 or after[0] == 10):
            return _fail(self, Http09Request())
    except BaseException as exc:
        return _fail(self, exc)
    return 0


cdef int _on_field(llhttp_t* p, const char* at, size_t length) noexcept:
    cdef LlhttpParser self = <LlhttpParser>p.data
    if not self.in_head:  # a trailer after a chunked body: counted against the limit, dropped
        self.trailer += length
        if self.trailer > self.max_head:
            try:
                return _fail(self, HeadTooLarge())
            except BaseException as exc:
                return _fail(self, exc)
    return 0


cdef const char* _HTTP = b"HTTP"


cdef int _on_protocol(llhttp_t* p, const char* at, size_t length) noexcept:
    """A piece of the start line's protocol name: only HTTP is spoken here (llhttp also accepts
    RTSP and ICE, which this proxy would otherwise forward as HTTP/1.1)."""
    cdef _Llhttp self = _parser(p)
    cdef size_t i
    for i in range(length):
        if self.protocol >= 4 or at[i] != _HTTP[self.protocol]:
            return _fail(self, ParseError("not an HTTP message"))
        self.protocol += 1
    return 0


cdef int _on_protocol_complete(llhttp_t* p) noexcept:
    cdef _Llhttp self = _parser(p)
    if self.protocol != 4:
        return _fail(self, ParseError("not an HTTP message"))
    self.protocol = 0
    return 0


cdef int _on_status(llhttp_t* p, const char* at, size_t length) noexcept:
    """A piece of a response's reason phrase: HTAB, SP, visible ASCII or obs-text (RFC 9112 4),
    as it is relayed to the client in one piece (llhttp lets other control bytes through)."""
    cdef size_t i
    cdef unsigned char c
    for i in range(length):
        c = <unsigned char>at[i]
        if (c < 32 and c != 9) or c == 127:
            return _fail(_parser(p), ParseError("invalid reason phrase"))
    return 0


cdef int _on_headers_complete(llhttp_t* p) noexcept:
    cdef _Llhttp self = _parser(p)
    cdef int skip
    try:
        skip = self.head()
    except BaseException as exc:
        _fail(self, exc)
        return -1
    # A protocol switch has no body here (llhttp then pauses); 1 also skips a body decoded here.
    return 1 if p.upgrade or skip else 0


cdef int _on_body(llhttp_t* p, const char* at, size_t length) noexcept:
    cdef LlhttpParser self = <LlhttpParser>p.data
    try:
        self.on_body(PyBytes_FromStringAndSize(at, length))
    except BaseException as exc:
        return _fail(self, exc)
    return 0


cdef int _on_message_complete(llhttp_t* p) noexcept:
    cdef LlhttpParser self = <LlhttpParser>p.data
    if self.own_body:  # only the head is complete: pause while this module decodes the body
        return HPE_PAUSED
    try:
        self.on_complete()
    except BaseException as exc:
        _fail(self, exc)
        return -1
    return 0


llhttp_settings_init(&_REQUEST_SETTINGS)
_REQUEST_SETTINGS.on_method = _on_method
_REQUEST_SETTINGS.on_url = _on_url
_REQUEST_SETTINGS.on_protocol = _on_protocol
_REQUEST_SETTINGS.on_protocol_complete = _on_protocol_complete
_REQUEST_SETTINGS.on_header_field = _on_field
_REQUEST_SETTINGS.on_header_value = _on_field
_REQUEST_SETTINGS.on_headers_complete = _on_headers_complete
_REQUEST_SETTINGS.on_body = _on_body
_REQUEST_SETTINGS.on_message_complete = _on_message_complete

llhttp_settings_init(&_RESPONSE_SETTINGS)
_RESPONSE_SETTINGS.on_protocol = _on_protocol
_RESPONSE_SETTINGS.on_protocol_complete = _on_protocol_complete
_RESPONSE_SETTINGS.on_status = _on_status
_RESPONSE_SETTINGS.on_headers_complete = _on_headers_complete
