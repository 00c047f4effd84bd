# Compiled layout of head.py (Cython "augmenting" declarations; see setup.py): the scans index the
# bytes as C chars. Keep the fields equal to ResponseHeaders.__slots__.
cimport cython

cdef class ResponseHeaders:
    cdef public bytes _raw
    cdef public Py_ssize_t _first, _end

cdef tuple _BY_LENGTH
cdef Py_ssize_t _LONGEST
cdef bytes _KEEP_ALIVE, _CLOSE
cdef bint _COMPILED
cdef dict HEADER_KEYS
cdef Py_ssize_t MAX_HEADER_KEYS

@cython.locals(key=str)
cpdef str header_key(bytes name)
cdef long _CONNECTION_BIT, _NAMES_BIT, _DROPPED

cdef (Py_ssize_t, Py_ssize_t) _clamp(bytes raw, Py_ssize_t first, Py_ssize_t end)
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

@cython.locals(out=list, n=Py_ssize_t, i=Py_ssize_t, at=Py_ssize_t, colon=Py_ssize_t, eol=Py_ssize_t)
cpdef list header_values(bytes raw, Py_ssize_t first, Py_ssize_t end, bytes lower, bint first_only)

@cython.locals(out=list, i=Py_ssize_t, at=Py_ssize_t, colon=Py_ssize_t, eol=Py_ssize_t)
cpdef list fields(bytes raw, Py_ssize_t first, Py_ssize_t end)
