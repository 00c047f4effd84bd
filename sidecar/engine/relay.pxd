# Compiled layout of relay.py (docs/architecture.md, "Compiled and pure-Python builds"): the
# framing scan reads the bytes as C chars.
cimport cython
from sidecar.engine._direct_socket cimport DirectSocket

# The modes and framing states as C constants (see relay.py: the public mode names stay Python ints).
cdef long _LENGTH, _CHUNKED, _DECHUNK, _EOF_CHUNKED, _EOF_RAW
cdef long _SIZE, _EXT, _SIZE_LF, _DATA, _DATA_CR, _DATA_LF, _TRAILER, _TRAILER_LINE, _TRAILER_LF, _END_LF, _DONE
cdef long _MAX_DIGITS, _CR, _LF, _HTAB, _DEL
cdef bytes _LAST_CHUNK

cdef class ClientOutput:
    cdef public object transport
    cdef public DirectSocket sock
    cdef public list parts
    cdef public bint closed
    cpdef flush(self)
    cdef send_buffer(self, const unsigned char *buf, Py_ssize_t n)

cdef class BodyRelay:
    cdef public ClientOutput output
    cdef public long mode, state, digits
    cdef public unsigned long long left
    cdef public Py_ssize_t budget
    cdef public unsigned long reads
    cdef public bint done
    cpdef Py_ssize_t feed(self, bytes data) except -1
    @cython.locals(mode=long, parts=list, left="unsigned long long")
    cdef Py_ssize_t feed_from(self, const unsigned char *buf, Py_ssize_t n, object data) except -1
    cdef _whole(self, const unsigned char *buf, Py_ssize_t n, object data)
    cpdef end_sent(self)
    cpdef bint eof(self) except -1
    @cython.locals(state=long, left="unsigned long long", digits=long, through=bint,
                   pos=Py_ssize_t, seg=Py_ssize_t, out=list, c="unsigned char", take=Py_ssize_t)
    cdef Py_ssize_t _chunks(self, const unsigned char *buf, Py_ssize_t n, object data, list parts) except -1
