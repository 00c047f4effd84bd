# C helpers for the compiled scans of sidecar/engine/head.py (a .pxd of inline functions only: no
# module of its own, nothing in the pure-Python build).
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.string cimport memchr


cdef inline Py_ssize_t find_byte(bytes raw, long c, Py_ssize_t i, Py_ssize_t end) noexcept:
    """Index of the first byte ``c`` in ``raw[i:end]`` (within ``raw``), ``end`` if there is none:
    memchr, which steps through a header line many bytes at a time."""
    cdef const char* p
    cdef const char* q
    if i >= end:
        return end
    p = PyBytes_AS_STRING(raw)
    q = <const char*>memchr(p + i, <int>c, <size_t>(end - i))
    return end if q == NULL else q - p


cdef inline bytes decimal_bytes(unsigned long long n):
    """``n`` in decimal digits, formatted in a C buffer (20 digits hold any 64-bit value)."""
    cdef char buf[20]
    cdef int i = 20
    while True:
        i -= 1
        buf[i] = <char>(48 + n % 10)
        n //= 10
        if n == 0:
            break
    return PyBytes_FromStringAndSize(buf + i, 20 - i)
