# C helpers for the compiled reads of sidecar/usage.py (a .pxd of inline functions only: no
# module of its own, nothing in the pure-Python build). They answer what usage.py's Python path
# answers, or SCAN_FALLBACK where they do not know (then that path decides): held to it by
# tests/test_usage.py's differential tests.
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.string cimport memchr, memcmp

cdef extern from "string.h" nogil:
    const void *memrchr(const void *s, int c, size_t n)  # (GNU: glibc and musl have it)

# What scan_usage_object found: interpret's answer for the object, or that it cannot tell.
cdef enum:
    SCAN_FALLBACK = 0  # not a shape it reads (escapes, floats or minus signs where counts go, deep
                       # nesting, a repeated count, invalid JSON, bytes cut short): the Python path
    SCAN_REPORTED = 1
    SCAN_SILENT = 2  # a whole object that says nothing of the prompt (interpret: None)
    SCAN_NO_CACHED = 3
    SCAN_MALFORMED = 4

# A count field of the object: absent, null, a non-negative integer below 2**53, or any other value.
cdef enum:
    _ABSENT = 0
    _NULL = 1
    _INT = 2
    _OTHER = 3
    _OBJECT = 4  # (a details member) an object; its cached_tokens is read

cdef enum:
    _MAX_DEPTH = 8  # nesting below the usage object that is skipped; deeper: the Python path
    _MAX_DIGITS = 15  # counts of more digits: the Python path (2**53 has 16)

cdef struct _Counts:
    int prompt, input, read, written, pdetails, idetails, pcached, icached
    long long prompt_v, input_v, read_v, written_v, pcached_v, icached_v


cdef inline Py_ssize_t rfind_usage_key(bytes raw, Py_ssize_t end) noexcept:
    """Where the last ``"usage"`` in ``raw[:end]`` begins, -1 if none: memrchr to each ``g``
    (rare in JSON's punctuation and keys), then the bytes around it compared."""
    cdef const char *p = PyBytes_AS_STRING(raw)
    cdef const char *q
    cdef Py_ssize_t top = end - 2  # the "g" of a key in raw[:end] is below: 4 bytes after its start
    while top > 4:
        q = <const char *>memrchr(p + 4, b'g', <size_t>(top - 4))
        if q == NULL:
            return -1
        if memcmp(q - 4, b'"usag', 5) == 0 and memcmp(q + 1, b'e"', 2) == 0:
            return q - p - 4
        top = q - p
    return -1


cdef inline Py_ssize_t _ws(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) noexcept:
    cdef unsigned char c
    while i < n:
        c = p[i]
        if c != 0x20 and c != 0x0A and c != 0x0D and c != 0x09:
            break
        i += 1
    return i


cdef inline Py_ssize_t _string(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) noexcept:
    """Past the string whose opening quote is at ``i``; -1 for one it does not read (an escape,
    a control or non-ASCII byte: UTF-8 and escapes are the Python path's) or cut by ``n``."""
    cdef unsigned char c
    i += 1
    while i < n:
        c = p[i]
        if c == 0x22:
            return i + 1
        if c == 0x5C or c < 0x20 or c >= 0x80:
            return -1
        i += 1
    return -1


cdef inline Py_ssize_t _number(const unsigned char *p, Py_ssize_t i, Py_ssize_t n, bint *integer,
                               long long *value) noexcept:
    """Past the JSON number at ``i``; ``integer`` and ``value`` when it is a non-negative
    integer of at most _MAX_DIGITS digits. -1 where it is not a number this reads: a minus sign,
    an exponent, a leading zero, more digits (the Python path's), or cut by ``n``."""
    cdef Py_ssize_t start = i
    cdef long long v = 0
    integer[0] = False
    if i >= n or p[i] < 0x30 or p[i] > 0x39:
        return -1
    if p[i] == 0x30 and i + 1 < n and 0x30 <= p[i + 1] <= 0x39:
        return -1
    while i < n and 0x30 <= p[i] <= 0x39:
        v = v * 10 + (p[i] - 0x30) if i - start < _MAX_DIGITS else v
        i += 1
    if i - start > _MAX_DIGITS or i >= n:
        return -1
    if p[i] == 0x2E:  # a fraction: digits
        i += 1
        if i >= n or p[i] < 0x30 or p[i] > 0x39:
            return -1
        while i < n and 0x30 <= p[i] <= 0x39:
            i += 1
        if i >= n or p[i] == 0x65 or p[i] == 0x45:
            return -1
        return i
    if p[i] == 0x65 or p[i] == 0x45:
        return -1
    integer[0] = True
    value[0] = v
    return i


cdef inline Py_ssize_t _value(const unsigned char *p, Py_ssize_t i, Py_ssize_t n, int depth, int *kind,
                              long long *count) noexcept:
    """Past the JSON value at ``i`` (whitespace before it skipped by the caller), its kind
    (_NULL, _INT with ``count``, _OBJECT or _OTHER); -1 where it cannot tell."""
    cdef unsigned char c
    cdef bint integer
    if i >= n:
        return -1
    c = p[i]
    if c == 0x22:
        kind[0] = _OTHER
        return _string(p, i, n)
    if c == 0x6E:
        kind[0] = _NULL
        return i + 4 if i + 4 < n and memcmp(p + i, b"null", 4) == 0 else -1
    if c == 0x74:
        kind[0] = _OTHER
        return i + 4 if i + 4 < n and memcmp(p + i, b"true", 4) == 0 else -1
    if c == 0x66:
        kind[0] = _OTHER
        return i + 5 if i + 5 < n and memcmp(p + i, b"false", 5) == 0 else -1
    if c == 0x7B or c == 0x5B:
        kind[0] = _OBJECT if c == 0x7B else _OTHER
        if depth >= _MAX_DEPTH:
            return -1
        return _skip_container(p, i, n, depth + 1)
    i = _number(p, i, n, &integer, count)
    kind[0] = _INT if integer else _OTHER
    return i


cdef inline Py_ssize_t _skip_container(const unsigned char *p, Py_ssize_t i, Py_ssize_t n, int depth) noexcept:
    """Past the object or array at ``i``, each value read as JSON; -1 where it cannot tell."""
    cdef bint obj = p[i] == 0x7B
    cdef unsigned char close = 0x7D if obj else 0x5D
    cdef int kind
    cdef long long ignored = 0
    i = _ws(p, i + 1, n)
    if i < n and p[i] == close:
        return i + 1
    while True:
        if obj:
            if i >= n or p[i] != 0x22:
                return -1
            i = _string(p, i, n)
            if i < 0:
                return -1
            i = _ws(p, i, n)
            if i >= n or p[i] != 0x3A:
                return -1
            i = _ws(p, i + 1, n)
        i = _value(p, i, n, depth, &kind, &ignored)
        if i < 0:
            return -1
        i = _ws(p, i, n)
        if i >= n:
            return -1
        if p[i] == close:
            return i + 1
        if p[i] != 0x2C:
            return -1
        i = _ws(p, i + 1, n)


cdef inline bint _is(const unsigned char *p, Py_ssize_t start, Py_ssize_t end, const char *name,
                     Py_ssize_t size) noexcept:
    return end - start == size and memcmp(p + start, name, <size_t>size) == 0


cdef inline Py_ssize_t _details(const unsigned char *p, Py_ssize_t i, Py_ssize_t n, int *cached,
                                long long *value) noexcept:
    """Past the details object at ``i``, its ``cached_tokens`` read; -1 where it cannot tell."""
    cdef Py_ssize_t key
    cdef int kind = _OTHER
    cdef long long count = 0
    i = _ws(p, i + 1, n)
    if i < n and p[i] == 0x7D:
        return i + 1
    while True:
        if i >= n or p[i] != 0x22:
            return -1
        key = i + 1
        i = _string(p, i, n)
        if i < 0:
            return -1
        if _is(p, key, i - 1, b"cached_tokens", 13):
            if cached[0] != _ABSENT:
                return -1  # repeated: the JSON parser keeps the last
            i = _ws(p, i, n)
            if i >= n or p[i] != 0x3A:
                return -1
            i = _value(p, _ws(p, i + 1, n), n, 2, &kind, &count)
            cached[0] = kind if kind != _OBJECT else _OTHER
            value[0] = count
        else:
            i = _ws(p, i, n)
            if i >= n or p[i] != 0x3A:
                return -1
            i = _value(p, _ws(p, i + 1, n), n, 2, &kind, &count)
        if i < 0:
            return -1
        i = _ws(p, i, n)
        if i >= n:
            return -1
        if p[i] == 0x7D:
            return i + 1
        if p[i] != 0x2C:
            return -1
        i = _ws(p, i + 1, n)


cdef inline int _with_details(int prompt, long long prompt_v, int details, int cached, long long cached_v) noexcept:
    if prompt != _INT:
        return SCAN_MALFORMED
    if details == _ABSENT or details == _NULL:
        return SCAN_NO_CACHED
    if details != _OBJECT:
        return SCAN_MALFORMED
    if cached == _ABSENT or cached == _NULL:
        return SCAN_NO_CACHED
    if cached != _INT or cached_v > prompt_v:
        return SCAN_MALFORMED
    return SCAN_REPORTED


cdef inline int scan_usage_object(bytes raw, Py_ssize_t i, Py_ssize_t limit, long long *counts) noexcept:
    """Read the usage object whose ``{`` is at ``raw[i]`` and that ends before ``limit``: what
    usage.interpret says of it (SCAN_SILENT for None; SCAN_REPORTED with ``counts[0]`` prompt and
    ``counts[1]`` cached tokens), or SCAN_FALLBACK."""
    cdef const unsigned char *p = <const unsigned char *>PyBytes_AS_STRING(raw)
    cdef Py_ssize_t n = limit, key, kend
    cdef _Counts f
    cdef int kind = _OTHER
    cdef long long count = 0
    cdef int *field
    cdef long long *value
    f.prompt = f.input = f.read = f.written = f.pdetails = f.idetails = f.pcached = f.icached = _ABSENT
    f.prompt_v = f.input_v = f.read_v = f.written_v = f.pcached_v = f.icached_v = 0
    i = _ws(p, i + 1, n)
    if i < n and p[i] == 0x7D:
        return SCAN_SILENT
    while True:
        if i >= n or p[i] != 0x22:
            return SCAN_FALLBACK
        key = i + 1
        i = _string(p, i, n)
        if i < 0:
            return SCAN_FALLBACK
        kend = i - 1
        field = NULL
        value = NULL
        if _is(p, key, kend, b"prompt_tokens", 13):
            field, value = &f.prompt, &f.prompt_v
        elif _is(p, key, kend, b"input_tokens", 12):
            field, value = &f.input, &f.input_v
        elif _is(p, key, kend, b"cache_read_input_tokens", 23):
            field, value = &f.read, &f.read_v
        elif _is(p, key, kend, b"cache_creation_input_tokens", 27):
            field, value = &f.written, &f.written_v
        i = _ws(p, i, n)
        if i >= n or p[i] != 0x3A:
            return SCAN_FALLBACK
        i = _ws(p, i + 1, n)
        if i < n and p[i] == 0x7B and _is(p, key, kend, b"prompt_tokens_details", 21):
            if f.pdetails != _ABSENT:
                return SCAN_FALLBACK
            f.pdetails = _OBJECT
            i = _details(p, i, n, &f.pcached, &f.pcached_v)
        elif i < n and p[i] == 0x7B and _is(p, key, kend, b"input_tokens_details", 20):
            if f.idetails != _ABSENT:
                return SCAN_FALLBACK
            f.idetails = _OBJECT
            i = _details(p, i, n, &f.icached, &f.icached_v)
        else:
            i = _value(p, i, n, 1, &kind, &count)
            if field != NULL:
                if field[0] != _ABSENT:
                    return SCAN_FALLBACK  # repeated: the JSON parser keeps the last
                field[0] = kind if kind != _OBJECT else _OTHER
                value[0] = count
            elif _is(p, key, kend, b"prompt_tokens_details", 21):
                if f.pdetails != _ABSENT:
                    return SCAN_FALLBACK
                f.pdetails = kind
            elif _is(p, key, kend, b"input_tokens_details", 20):
                if f.idetails != _ABSENT:
                    return SCAN_FALLBACK
                f.idetails = kind
        if i < 0:
            return SCAN_FALLBACK
        i = _ws(p, i, n)
        if i >= n:
            return SCAN_FALLBACK
        if p[i] == 0x7D:
            break
        if p[i] != 0x2C:
            return SCAN_FALLBACK
        i = _ws(p, i + 1, n)
    # interpret(), on the fields read
    if f.prompt != _ABSENT:
        counts[0], counts[1] = f.prompt_v, f.pcached_v
        return _with_details(f.prompt, f.prompt_v, f.pdetails, f.pcached, f.pcached_v)
    if f.input == _ABSENT:
        return SCAN_SILENT
    if f.read != _ABSENT or f.written != _ABSENT:  # Anthropic
        if f.read == _ABSENT or f.read == _NULL:
            return SCAN_NO_CACHED if f.input == _INT else SCAN_MALFORMED
        if f.written == _ABSENT or f.written == _NULL:
            f.written, f.written_v = _INT, 0
        if f.input != _INT or f.read != _INT or f.written != _INT:
            return SCAN_MALFORMED
        counts[0], counts[1] = f.input_v + f.read_v + f.written_v, f.read_v
        return SCAN_REPORTED
    counts[0], counts[1] = f.input_v, f.icached_v
    return _with_details(f.input, f.input_v, f.idetails, f.icached, f.icached_v)


cdef inline bint framing_may_cut_key(bytes raw, Py_ssize_t start, Py_ssize_t end) noexcept:
    """usage._may_cut_key for ``raw[start:end]``, in one pass from CR to CR (memchr): its CRLFs
    are counted, and each is looked at for a usage key's part on either side of it (every
    pattern of usage._KEY_CUT holds a CRLF)."""
    cdef const char *p = PyBytes_AS_STRING(raw)
    cdef const char *q
    cdef Py_ssize_t c, crlfs = 0, at = start
    while at < end:
        q = <const char *>memchr(p + at, b'\r', <size_t>(end - at))
        if q == NULL:
            break
        c = q - p
        at = c + 1
        if c + 1 >= end or p[c + 1] != b'\n':
            continue
        crlfs += 1
        at = c + 2
        if (  # usage._KEY_CUT's patterns around this CRLF
            (c + 8 <= end and memcmp(q + 2, b'usage"', 6) == 0)
            or (c + 7 <= end and memcmp(q + 2, b'sage"', 5) == 0)
            or (c - 3 >= start and memcmp(q - 3, b'"us', 3) == 0)
            or (c - 4 >= start and memcmp(q - 4, b'"usa', 4) == 0)
            or (c - 5 >= start and memcmp(q - 5, b'"usag', 5) == 0)
            or (c - 6 >= start and memcmp(q - 6, b'"usage', 6) == 0)
            or (c - 7 >= start and memcmp(q - 7, b'"usage"', 7) == 0)
        ):
            return True
    return crlfs * 16 > end - start
