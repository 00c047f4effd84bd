# Compiled layout of fast_client.py (Cython "augmenting" declarations; see setup.py). Keep the
# fields equal to each class's __slots__; C types only where every assignment has that type.
cimport cython
from sidecar.engine.flow cimport ReadFlow

cdef class ResponseHeaders:
    cdef public list _headers

cdef class UpstreamConnection:
    cdef public UpstreamPool pool
    cdef public object transport, parser, ex, _poll, reason
    cdef public ReadFlow flow
    cdef public list headers
    cdef public long framing
    cdef public bint lost, counted, in_head, head_seen, informational, done, keep_alive, reusable, eof_ends
    cdef public bint write_paused
    cdef public Py_ssize_t head_bytes
    cdef public double idle_since, stamp
    cdef public long relay
    cdef public list sink
    @cython.locals(name=bytes, value=bytes, key=str)
    cpdef on_header(self, name, value)

cdef class UpstreamPool:
    cdef public object loop, host, idle, waiters, tasks
    cdef public long port, limit, total
    cdef public bint closed
