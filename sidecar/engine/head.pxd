# Compiled layout of head.py (docs/architecture.md, "Compiled and pure-Python builds"): the scans
# index the bytes as C chars.
cimport cython
from sidecar.engine._memscan cimport decimal_bytes, find_byte
from sidecar.headers cimport HeaderView

cdef class HeaderBlock(HeaderView):
    cdef public bytes _raw
    cdef public Py_ssize_t _first, _end
    cdef public unsigned long long _mask
    cdef public dict _decoded
    @cython.locals(lower=bytes, value=bytes, mask="unsigned long long", one="unsigned long long", text=str,
                   n=Py_ssize_t)
    cpdef get(self, key, default=*)

cdef inline long _bit(Py_ssize_t n, long last)
cdef inline long _name_bit(bytes raw, Py_ssize_t at, Py_ssize_t n)
cdef bytes _key_bytes(key)
@cython.locals(one="unsigned long long", mask="unsigned long long", i=Py_ssize_t, at=Py_ssize_t,
               colon=Py_ssize_t, eol=Py_ssize_t)
cdef unsigned long long _name_mask(bytes raw, Py_ssize_t first, Py_ssize_t end)

cdef tuple _BY_LENGTH
cdef Py_ssize_t _LONGEST
cdef bytes _HOST, _KEEP_ALIVE, _CLOSE, _HOST_CLASS
cdef long _REG_NAME, _IP_LITERAL, _HEX
cdef dict _TABLES
cdef Py_ssize_t MAX_TABLES
cdef bint _COMPILED
cdef dict _KEY_BYTES
cdef Py_ssize_t MAX_KEYS
cdef long _CONNECTION_BIT, _NAMES_BIT, _DROPPED, _LISTED, _HOST_SEEN, _HOST_REPEATED, _HOST_INVALID

cdef (Py_ssize_t, Py_ssize_t) _clamp(bytes raw, Py_ssize_t first, Py_ssize_t end)
@cython.locals(p="const char *")
cpdef bytes cut(bytes raw, Py_ssize_t start, Py_ssize_t stop)
@cython.locals(n=Py_ssize_t, i=Py_ssize_t, c=long)
cpdef Py_ssize_t head_end(bytes raw, Py_ssize_t at) except? -2
cpdef bytes decimal(unsigned long long n)

cdef inline Py_ssize_t _find(bytes raw, long c, Py_ssize_t i, Py_ssize_t end)
@cython.locals(colon=Py_ssize_t, eol=Py_ssize_t)
cdef inline (Py_ssize_t, Py_ssize_t) _line(bytes raw, Py_ssize_t at, Py_ssize_t end)
@cython.locals(v=Py_ssize_t)
cdef inline Py_ssize_t _value_at(bytes raw, Py_ssize_t colon, Py_ssize_t eol)
@cython.locals(k=Py_ssize_t, c=long)
cdef inline bint _same(bytes raw, Py_ssize_t at, bytes lower)
@cython.locals(name=bytes, bit=long)
cdef long _class(bytes raw, Py_ssize_t at, Py_ssize_t n)
@cython.locals(v=Py_ssize_t, n=Py_ssize_t)
cdef bint _plain_connection(bytes raw, Py_ssize_t colon, Py_ssize_t eol)

@cython.locals(n=Py_ssize_t, start=Py_ssize_t, first=Py_ssize_t, end=Py_ssize_t, blank=Py_ssize_t)
cpdef (Py_ssize_t, Py_ssize_t, Py_ssize_t) locate(bytes raw, Py_ssize_t at)
cpdef bytes reason_phrase(bytes raw, Py_ssize_t start, Py_ssize_t first)

@cython.locals(bits=long, run=Py_ssize_t, i=Py_ssize_t, at=Py_ssize_t, colon=Py_ssize_t, eol=Py_ssize_t, cls=long,
               n=Py_ssize_t)
cpdef long relay_block(bytes raw, Py_ssize_t first, Py_ssize_t end, list out, extra) except -1

@cython.locals(n=Py_ssize_t, at=Py_ssize_t, eol=Py_ssize_t)
cdef inline (Py_ssize_t, Py_ssize_t) _next_value(bytes raw, Py_ssize_t i, Py_ssize_t end, bytes lower)
@cython.locals(out=list, v=Py_ssize_t, eol=Py_ssize_t)
cpdef list header_values(bytes raw, Py_ssize_t first, Py_ssize_t end, bytes lower, bint first_only)

@cython.locals(found=list, v=Py_ssize_t, eol=Py_ssize_t)
cpdef bytes first_value(bytes raw, Py_ssize_t first, Py_ssize_t end, bytes lower)


@cython.locals(table=tuple, by_length=list)
cpdef tuple name_table(frozenset names)
@cython.locals(names=tuple, name=bytes)
cdef bint _listed(bytes raw, Py_ssize_t at, Py_ssize_t n, tuple table)
@cython.locals(at=Py_ssize_t, colon=Py_ssize_t, eol=Py_ssize_t)
cdef (Py_ssize_t, Py_ssize_t) _next_listed(bytes raw, Py_ssize_t i, Py_ssize_t end, tuple table)
@cython.locals(run=Py_ssize_t, at=Py_ssize_t, nxt=Py_ssize_t)
cpdef copy_block(bytes raw, Py_ssize_t first, Py_ssize_t end, list out, tuple table)
@cython.locals(bits=long, i=Py_ssize_t, at=Py_ssize_t, colon=Py_ssize_t, eol=Py_ssize_t, n=Py_ssize_t)
cpdef long scan_request(bytes raw, Py_ssize_t first, Py_ssize_t end, tuple table) except -1
@cython.locals(n=Py_ssize_t, i=Py_ssize_t, c=long)
cpdef bint dot_segment(bytes target) except -1
cdef bint _dot_segments(bytes target) except -1
cpdef origin_form(bytes target)
@cython.locals(i=Py_ssize_t)
cpdef bint valid_host(bytes raw, Py_ssize_t start, Py_ssize_t stop)
cpdef bint has_header(bytes raw, Py_ssize_t first, Py_ssize_t end, bytes lower)

@cython.locals(out=dict)
cpdef dict decoded(bytes raw, Py_ssize_t first, Py_ssize_t end)
cpdef header_map(bytes raw, Py_ssize_t first, Py_ssize_t end)
