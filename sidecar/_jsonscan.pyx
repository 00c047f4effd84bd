# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled build's JSON scanner, body copies and body-patch members: the contracts,
statuses and limits are those of :mod:`sidecar.jsonscan`, which uses this module when it is built.

One pass over the bytes in C, a byte per container on a stack array, no Python object until
the hits are handed back. String content, most of a prompt's bytes, is skipped 16 bytes at a
time (SSE2) or 8 (elsewhere) up to the next byte that needs a look. Inputs above ``NOGIL_BYTES`` are scanned with the GIL released, so a
large body scanned on a worker thread leaves the event loop's thread running meanwhile.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_Next
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from libc.stdint cimport uint64_t
from libc.string cimport memcmp, memcpy

cdef enum:
    INVALID = -1
    TOO_DEEP = -2
    TOO_MANY = -3
    MAX_HITS = 64
    MAX_DEPTH = 1024
    MAX_NAMES = 16
    # The longest key compared after decoding its escapes (names are short identifiers).
    KEY_BUFFER = 256
    NOGIL_BYTES = 64 * 1024
    FEW_EDITS = 16
    # members_json writes up to this many bytes itself (a body patch's few members); more go
    # to orjson.
    MEMBERS_BUFFER = 1024

cdef extern from "Python.h":
    bint _is_ascii "PyUnicode_IS_ASCII" (object s)
    Py_ssize_t _str_length "PyUnicode_GET_LENGTH" (object s)
    const unsigned char* _ascii_data "PyUnicode_1BYTE_DATA" (object s)
    long long _long_value "PyLong_AsLongLongAndOverflow" (object n, int* overflow)

import orjson

# Token kinds and parser states, as in sidecar.jsonscan.
cdef enum:
    K_STR = 1
    K_SCALAR
    K_OPEN_OBJ
    K_OPEN_ARR
    K_CLOSE
    K_COMMA
    K_COLON

cdef enum:
    S_VALUE = 0
    S_FIRST_ITEM
    S_FIRST_KEY
    S_KEY
    S_COLON
    S_AFTER

# For the tests: the constants sidecar.jsonscan states.
CONSTANTS = {"INVALID": INVALID, "TOO_DEEP": TOO_DEEP, "TOO_MANY": TOO_MANY, "MAX_HITS": MAX_HITS,
             "MAX_DEPTH": MAX_DEPTH, "MAX_NAMES": MAX_NAMES}


cdef struct Names:
    int count
    const unsigned char* ptr[MAX_NAMES]
    Py_ssize_t size[MAX_NAMES]


cdef struct Found:
    Py_ssize_t vstart, vend, last
    int count  # numbers used in hits
    Py_ssize_t hits[MAX_HITS * 5]


def scan(bytes data, Py_ssize_t start, Py_ssize_t end, int max_depth, tuple names=()):
    """See :func:`sidecar.jsonscan.scan`."""
    cdef Names n
    cdef Found f
    cdef int status
    _names(names, &n)
    _check_span(data, start, end)
    if max_depth > MAX_DEPTH:
        max_depth = MAX_DEPTH
    cdef const unsigned char* p = <const unsigned char*> PyBytes_AS_STRING(data)
    if end - start > NOGIL_BYTES:
        with nogil:
            status = _walk(p, start, end, max_depth, &n, 0, &f)
    else:
        status = _walk(p, start, end, max_depth, &n, 0, &f)
    if status < 0:
        return status, 0, 0, 0, []
    return status, f.vstart, f.vend, f.last, [f.hits[i] for i in range(f.count)]


def elements(bytes data, Py_ssize_t start, Py_ssize_t end, int limit):
    """See :func:`sidecar.jsonscan.elements`."""
    cdef Names n
    cdef Found f
    n.count = 0
    _check_span(data, start, end)
    if limit > MAX_HITS:
        limit = MAX_HITS
    if limit <= 0:
        return []
    cdef const unsigned char* p = <const unsigned char*> PyBytes_AS_STRING(data)
    if _walk(p, start, end, MAX_DEPTH, &n, limit, &f) < 0:
        return []
    return [f.hits[i] for i in range(f.count)]


def assemble(bytes data, list edits):
    """See :func:`sidecar.jsonscan.assemble`."""
    cdef Py_ssize_t count = len(edits), size = PyBytes_GET_SIZE(data), total, pos = 0, i, start, stop
    # A splice makes a few edits: on the stack, unless there are many.
    cdef Py_ssize_t spans_here[2 * FEW_EDITS]
    cdef const char* parts_here[FEW_EDITS]
    cdef Py_ssize_t sizes_here[FEW_EDITS]
    cdef Py_ssize_t* spans = spans_here
    cdef const char** parts = parts_here
    cdef Py_ssize_t* sizes = sizes_here
    cdef bytes out
    cdef char* dest
    cdef const char* src = PyBytes_AS_STRING(data)
    if count > FEW_EDITS:
        spans = <Py_ssize_t*> PyMem_Malloc(2 * count * sizeof(Py_ssize_t))
        parts = <const char**> PyMem_Malloc(count * sizeof(const char*))
        sizes = <Py_ssize_t*> PyMem_Malloc(count * sizeof(Py_ssize_t))
        if spans == NULL or parts == NULL or sizes == NULL:
            PyMem_Free(spans)
            PyMem_Free(parts)
            PyMem_Free(sizes)
            raise MemoryError()
    try:
        total = size
        for i in range(count):
            start, stop, replacement = edits[i]
            if type(replacement) is not bytes:
                raise TypeError("replacements are bytes")
            if start < pos or stop < start or stop > size:
                raise ValueError("edits must be sorted and not overlap")
            spans[2 * i] = start
            spans[2 * i + 1] = stop
            parts[i] = PyBytes_AS_STRING(replacement)
            sizes[i] = PyBytes_GET_SIZE(replacement)
            total += sizes[i] - (stop - start)
            pos = stop
        out = PyBytes_FromStringAndSize(NULL, total)
        dest = PyBytes_AS_STRING(out)
        # The edits hold their replacements: the pointers stay valid without the GIL.
        if total > NOGIL_BYTES:
            with nogil:
                _copy_edited(src, size, spans, parts, sizes, count, dest)
        else:
            _copy_edited(src, size, spans, parts, sizes, count, dest)
        return out
    finally:
        if count > FEW_EDITS:
            PyMem_Free(spans)
            PyMem_Free(parts)
            PyMem_Free(sizes)


def join(list chunks):
    """See :func:`sidecar.jsonscan.join`."""
    cdef Py_ssize_t count = len(chunks), total = 0, i
    cdef const char** parts = <const char**> PyMem_Malloc((count + 1) * sizeof(const char*))
    cdef Py_ssize_t* sizes = <Py_ssize_t*> PyMem_Malloc((count + 1) * sizeof(Py_ssize_t))
    cdef bytes out
    cdef char* dest
    if parts == NULL or sizes == NULL:
        PyMem_Free(parts)
        PyMem_Free(sizes)
        raise MemoryError()
    try:
        for i in range(count):
            chunk = chunks[i]
            if type(chunk) is not bytes:
                raise TypeError("chunks are bytes")
            parts[i] = PyBytes_AS_STRING(chunk)
            sizes[i] = PyBytes_GET_SIZE(chunk)
            total += sizes[i]
        out = PyBytes_FromStringAndSize(NULL, total)
        dest = PyBytes_AS_STRING(out)
        # The list holds the chunks: the pointers stay valid without the GIL.
        if total > NOGIL_BYTES:
            with nogil:
                _copy_all(parts, sizes, count, dest)
        else:
            _copy_all(parts, sizes, count, dest)
        return out
    finally:
        PyMem_Free(parts)
        PyMem_Free(sizes)


cdef void _copy_all(const char** parts, const Py_ssize_t* sizes, Py_ssize_t count, char* dest) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(count):
        memcpy(dest, parts[i], sizes[i])
        dest += sizes[i]


cdef void _copy_edited(const char* src, Py_ssize_t size, const Py_ssize_t* spans, const char** parts,
                       const Py_ssize_t* sizes, Py_ssize_t count, char* dest) noexcept nogil:
    cdef Py_ssize_t pos = 0, i, n
    for i in range(count):
        n = spans[2 * i] - pos
        memcpy(dest, src + pos, n)
        dest += n
        memcpy(dest, parts[i], sizes[i])
        dest += sizes[i]
        pos = spans[2 * i + 1]
    memcpy(dest, src + pos, size - pos)


cdef void _names(tuple names, Names* n) except *:
    if len(names) > MAX_NAMES:
        raise ValueError(f"at most {MAX_NAMES} names")
    n.count = len(names)
    cdef int i
    for i in range(n.count):
        name = names[i]
        if type(name) is not bytes:
            raise TypeError("names must be bytes")
        n.ptr[i] = <const unsigned char*> PyBytes_AS_STRING(name)
        n.size[i] = PyBytes_GET_SIZE(name)


cdef void _check_span(bytes data, Py_ssize_t start, Py_ssize_t end) except *:
    if start < 0 or end > PyBytes_GET_SIZE(data) or start > end:
        raise ValueError("span out of range")


cdef inline bint _is_hex(unsigned char c) noexcept nogil:
    return (48 <= c <= 57) or (97 <= c <= 102) or (65 <= c <= 70)


cdef inline int _hex(unsigned char c) noexcept nogil:
    if c <= 57:
        return c - 48
    if c >= 97:
        return c - 87
    return c - 55


cdef inline Py_ssize_t _utf8(const unsigned char* p, Py_ssize_t i, Py_ssize_t end) noexcept nogil:
    """The length of the strict UTF-8 sequence at p[i] (a byte >= 0x80), 0 if invalid."""
    cdef unsigned char c = p[i]
    cdef unsigned char lo = 0x80, hi = 0xBF
    cdef Py_ssize_t n, k
    if 0xC2 <= c <= 0xDF:
        n = 2
    elif 0xE0 <= c <= 0xEF:
        n = 3
        if c == 0xE0:
            lo = 0xA0  # no overlong forms
        elif c == 0xED:
            hi = 0x9F  # no surrogates
    elif 0xF0 <= c <= 0xF4:
        n = 4
        if c == 0xF0:
            lo = 0x90
        elif c == 0xF4:
            hi = 0x8F  # nothing above U+10FFFF
    else:
        return 0
    if i + n > end or not (lo <= p[i + 1] <= hi):
        return 0
    for k in range(2, n):
        if not (0x80 <= p[i + k] <= 0xBF):
            return 0
    return n


# Eight bytes at a time (SWAR): a word with none of a quote, a backslash, a control byte or a
# non-ASCII byte is plain string content.
cdef uint64_t ONES = 0x0101010101010101ULL
cdef uint64_t HIGHS = 0x8080808080808080ULL


# Sixteen bytes at a time where SSE2 is there (every x86-64): the same test, one compare per
# kind. A signed compare below 0x20 takes both the control bytes and the non-ASCII ones.
cdef extern from *:
    """
    #if defined(__SSE2__)
    #include <emmintrin.h>
    static inline Py_ssize_t sidecar_plain16(const unsigned char* p, Py_ssize_t i, Py_ssize_t end) {
        const __m128i quote = _mm_set1_epi8(34), backslash = _mm_set1_epi8(92), space = _mm_set1_epi8(32);
        while (i + 16 <= end) {
            __m128i x = _mm_loadu_si128((const __m128i*)(p + i));
            int mask = _mm_movemask_epi8(_mm_or_si128(
                _mm_or_si128(_mm_cmpeq_epi8(x, quote), _mm_cmpeq_epi8(x, backslash)), _mm_cmplt_epi8(x, space)));
            if (mask)
                return i + __builtin_ctz((unsigned int)mask);
            i += 16;
        }
        return i;
    }
    #else
    static inline Py_ssize_t sidecar_plain16(const unsigned char* p, Py_ssize_t i, Py_ssize_t end) { return i; }
    #endif
    """
    # The index of the first quote, backslash, control or non-ASCII byte from p[i], or of the
    # first byte of the last (under 16) bytes before end; i itself without SSE2.
    Py_ssize_t _plain16 "sidecar_plain16" (const unsigned char* p, Py_ssize_t i, Py_ssize_t end) noexcept nogil


cdef inline uint64_t _special8(uint64_t x) noexcept nogil:
    cdef uint64_t q = x ^ (ONES * 34), b = x ^ (ONES * 92)
    return (((x - ONES * 32) & ~x) | ((q - ONES) & ~q) | ((b - ONES) & ~b) | x) & HIGHS


cdef Py_ssize_t _string(const unsigned char* p, Py_ssize_t i, Py_ssize_t end, bint* escaped) noexcept nogil:
    """The index after the string that starts at p[i] (a quote), -1 if it is invalid."""
    cdef unsigned char c
    cdef Py_ssize_t n
    cdef uint64_t word
    i += 1
    while i < end:
        i = _plain16(p, i, end)
        while i + 8 <= end:
            memcpy(&word, p + i, 8)
            if _special8(word):
                break
            i += 8
        if i >= end:
            return -1
        c = p[i]
        if c == 34:
            return i + 1
        if c == 92:
            escaped[0] = True
            if i + 1 >= end:
                return -1
            c = p[i + 1]
            if c == 117:  # \uXXXX
                if i + 5 >= end or not (_is_hex(p[i + 2]) and _is_hex(p[i + 3]) and _is_hex(p[i + 4])
                                         and _is_hex(p[i + 5])):
                    return -1
                i += 6
            elif c == 34 or c == 92 or c == 47 or c == 98 or c == 102 or c == 110 or c == 114 or c == 116:
                i += 2
            else:
                return -1
        elif c < 32:
            return -1
        elif c < 128:
            i += 1
        else:
            n = _utf8(p, i, end)
            if n == 0:
                return -1
            i += n
    return -1


cdef Py_ssize_t _number(const unsigned char* p, Py_ssize_t i, Py_ssize_t end) noexcept nogil:
    """The index after the number that starts at p[i], -1 if it is invalid."""
    if p[i] == 45:  # -
        i += 1
    if i >= end or not (48 <= p[i] <= 57):
        return -1
    if p[i] == 48:
        i += 1
    else:
        while i < end and 48 <= p[i] <= 57:
            i += 1
    if i < end and p[i] == 46:  # .
        i += 1
        if i >= end or not (48 <= p[i] <= 57):
            return -1
        while i < end and 48 <= p[i] <= 57:
            i += 1
    if i < end and (p[i] == 101 or p[i] == 69):  # e E
        i += 1
        if i < end and (p[i] == 43 or p[i] == 45):
            i += 1
        if i >= end or not (48 <= p[i] <= 57):
            return -1
        while i < end and 48 <= p[i] <= 57:
            i += 1
    return i


cdef int _key(const unsigned char* p, Py_ssize_t ks, Py_ssize_t ke, bint escaped, const Names* n) noexcept nogil:
    """The index of the name the (valid) key p[ks:ke] equals, -1 if none."""
    cdef unsigned char buf[KEY_BUFFER + 4]
    cdef const unsigned char* key = p + ks + 1
    cdef Py_ssize_t size = ke - ks - 2, j, out
    cdef unsigned int cp, low
    cdef unsigned char c
    cdef int i
    if escaped:
        j = ks + 1
        out = 0
        while j < ke - 1:
            if out > KEY_BUFFER:
                return -1
            c = p[j]
            if c != 92:
                buf[out] = c
                out += 1
                j += 1
                continue
            c = p[j + 1]
            if c != 117:
                buf[out] = (34 if c == 34 else 92 if c == 92 else 47 if c == 47 else 8 if c == 98 else
                            12 if c == 102 else 10 if c == 110 else 13 if c == 114 else 9)
                out += 1
                j += 2
                continue
            cp = (_hex(p[j + 2]) << 12) | (_hex(p[j + 3]) << 8) | (_hex(p[j + 4]) << 4) | _hex(p[j + 5])
            j += 6
            if 0xDC00 <= cp <= 0xDFFF:
                return -1  # an unpaired surrogate matches no name
            if 0xD800 <= cp <= 0xDBFF:
                if j + 6 > ke - 1 or p[j] != 92 or p[j + 1] != 117:
                    return -1
                low = (_hex(p[j + 2]) << 12) | (_hex(p[j + 3]) << 8) | (_hex(p[j + 4]) << 4) | _hex(p[j + 5])
                if not (0xDC00 <= low <= 0xDFFF):
                    return -1
                j += 6
                cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00)
            if cp < 0x80:
                buf[out] = cp
                out += 1
            elif cp < 0x800:
                buf[out] = 0xC0 | (cp >> 6)
                buf[out + 1] = 0x80 | (cp & 0x3F)
                out += 2
            elif cp < 0x10000:
                buf[out] = 0xE0 | (cp >> 12)
                buf[out + 1] = 0x80 | ((cp >> 6) & 0x3F)
                buf[out + 2] = 0x80 | (cp & 0x3F)
                out += 3
            else:
                buf[out] = 0xF0 | (cp >> 18)
                buf[out + 1] = 0x80 | ((cp >> 12) & 0x3F)
                buf[out + 2] = 0x80 | ((cp >> 6) & 0x3F)
                buf[out + 3] = 0x80 | (cp & 0x3F)
                out += 4
        key = buf
        size = out
    for i in range(n.count):
        if n.size[i] == size and memcmp(n.ptr[i], key, size) == 0:
            return i
    return -1


cdef int _walk(const unsigned char* p, Py_ssize_t start, Py_ssize_t end, int max_depth, const Names* n,
               int limit, Found* f) noexcept nogil:
    """The scanner (the state machine of sidecar.jsonscan._walk, a byte at a time)."""
    cdef unsigned char stack[MAX_DEPTH + 1]  # the open containers, 1 for an object
    cdef int depth = 0, deepest = 0, state = S_VALUE, kind, member = -1
    cdef Py_ssize_t pos = start, tok, ks = 0, ke = 0, vs = 0
    cdef unsigned char c
    cdef bint escaped = False
    f.count = 0
    f.vstart = f.vend = f.last = 0
    while pos < end:
        c = p[pos]
        if c == 32 or c == 10 or c == 13 or c == 9:
            pos += 1
            continue
        tok = pos
        if c == 34:
            escaped = False
            pos = _string(p, pos, end, &escaped)
            if pos < 0:
                return INVALID
            kind = K_STR
        elif c == 123:
            kind = K_OPEN_OBJ
            pos += 1
        elif c == 91:
            kind = K_OPEN_ARR
            pos += 1
        elif c == 125 or c == 93:
            kind = K_CLOSE
            pos += 1
        elif c == 44:
            kind = K_COMMA
            pos += 1
        elif c == 58:
            kind = K_COLON
            pos += 1
        elif c == 45 or 48 <= c <= 57:
            pos = _number(p, pos, end)
            if pos < 0:
                return INVALID
            kind = K_SCALAR
        elif c == 116 and pos + 4 <= end and memcmp(p + pos, b"true", 4) == 0:
            pos += 4
            kind = K_SCALAR
        elif c == 102 and pos + 5 <= end and memcmp(p + pos, b"false", 5) == 0:
            pos += 5
            kind = K_SCALAR
        elif c == 110 and pos + 4 <= end and memcmp(p + pos, b"null", 4) == 0:
            pos += 4
            kind = K_SCALAR
        else:
            return INVALID
        if state == S_AFTER:
            if kind == K_COMMA:
                if depth == 0:
                    return INVALID
                state = S_KEY if stack[depth] else S_VALUE
                continue
            if kind != K_CLOSE or depth == 0 or stack[depth] != (c == 125):
                return INVALID
            depth -= 1
        elif state == S_COLON:
            if kind != K_COLON:
                return INVALID
            state = S_VALUE
            continue
        elif state >= S_FIRST_KEY:
            if kind == K_STR:
                if depth == 1:
                    ks = tok
                    ke = pos
                    member = _key(p, ks, ke, escaped, n) if n.count else -1
                state = S_COLON
                continue
            if kind != K_CLOSE or state != S_FIRST_KEY or c != 125:
                return INVALID
            depth -= 1
        elif kind == K_CLOSE and state == S_FIRST_ITEM and c == 93:
            depth -= 1
        else:
            if depth == 1:
                vs = tok
            elif depth == 0:
                f.vstart = tok
                f.last = pos
            if kind != K_STR and kind != K_SCALAR:
                if kind != K_OPEN_OBJ and kind != K_OPEN_ARR:
                    return INVALID
                depth += 1
                if depth > deepest:
                    deepest = depth
                    if depth > max_depth:
                        return TOO_DEEP
                stack[depth] = kind == K_OPEN_OBJ
                state = S_FIRST_KEY if kind == K_OPEN_OBJ else S_FIRST_ITEM
                continue
        # A value ended at pos: a scalar, or a container closed.
        state = S_AFTER
        if depth == 1:
            f.last = pos
            if member >= 0:
                if f.count == 5 * MAX_HITS:
                    return TOO_MANY
                f.hits[f.count] = member
                f.hits[f.count + 1] = ks
                f.hits[f.count + 2] = ke
                f.hits[f.count + 3] = vs
                f.hits[f.count + 4] = pos
                f.count += 5
                member = -1
            elif limit and not stack[1]:
                f.hits[f.count] = vs
                f.hits[f.count + 1] = pos
                f.count += 2
                if f.count == 2 * limit:
                    return deepest
        elif depth == 0:
            f.vend = pos
    if state != S_AFTER or depth:
        return INVALID
    return deepest


def members_json(values):
    """See :func:`sidecar.jsonscan.members_json`. Written here when every key is a str and every
    value a str, int, bool or None, the strings ASCII with nothing to escape (a session id, an
    action word); anything else is serialized by orjson, so the bytes and errors are orjson's."""
    cdef char buf[MEMBERS_BUFFER]
    cdef Py_ssize_t at = 0, pos = 0
    cdef PyObject* key
    cdef PyObject* value
    if type(values) is not dict:
        return _members_orjson(values)
    while PyDict_Next(values, &pos, &key, &value):
        if at:
            at = _put(buf, at, b",", 1)
        at = _put_str(buf, at, <object>key)
        at = _put(buf, at, b":", 1)
        at = _put_value(buf, at, <object>value)
        if at < 0:
            return _members_orjson(values)
    return PyBytes_FromStringAndSize(buf, at)


def _members_orjson(values):
    serialized = orjson.dumps(values)
    return serialized[1:len(serialized) - 1]


cdef Py_ssize_t _put(char* buf, Py_ssize_t at, const char* text, Py_ssize_t n) noexcept:
    """Append ``n`` bytes at ``at``: the new end, or -1 (also when ``at`` is -1) past the buffer."""
    if at < 0 or at + n > MEMBERS_BUFFER:
        return -1
    memcpy(buf + at, text, n)
    return at + n


cdef Py_ssize_t _put_str(char* buf, Py_ssize_t at, object s) noexcept:
    """Append ``s`` as a JSON string when it is an ASCII str with no byte to escape; else -1."""
    cdef Py_ssize_t n, i
    cdef const unsigned char* p
    cdef unsigned char c
    cdef uint64_t word
    if at < 0 or type(s) is not str or not _is_ascii(s):
        return -1
    n = _str_length(s)
    if at + n + 2 > MEMBERS_BUFFER:
        return -1
    p = _ascii_data(s)
    # What orjson escapes: control bytes, quote, backslash (the scanner's tests, a block at a time).
    i = _plain16(p, 0, n)
    while i + 8 <= n:
        memcpy(&word, p + i, 8)
        if _special8(word):
            return -1
        i += 8
    while i < n:
        c = p[i]
        if c < 0x20 or c == 0x22 or c == 0x5C:
            return -1
        i += 1
    buf[at] = 0x22
    memcpy(buf + at + 1, p, n)
    buf[at + n + 1] = 0x22
    return at + n + 2


cdef Py_ssize_t _put_value(char* buf, Py_ssize_t at, object value) noexcept:
    """Append a str, an int within 64 signed bits, a bool or None; else -1."""
    cdef int overflow = 0
    cdef long long n
    cdef unsigned long long u
    cdef char digits[24]
    cdef int i = 24
    if type(value) is str:
        return _put_str(buf, at, value)
    if value is None:
        return _put(buf, at, b"null", 4)
    if value is True:
        return _put(buf, at, b"true", 4)
    if value is False:
        return _put(buf, at, b"false", 5)
    if type(value) is not int:
        return -1
    n = _long_value(value, &overflow)
    if overflow:
        return -1
    u = <unsigned long long> n if n >= 0 else (<unsigned long long> -(n + 1)) + 1
    while True:
        i -= 1
        digits[i] = <char> (0x30 + u % 10)
        u //= 10
        if not u:
            break
    if n < 0:
        i -= 1
        digits[i] = 0x2D  # -
    return _put(buf, at, digits + i, 24 - i)
