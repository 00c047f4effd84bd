# Compiled layout of fast_client.py (Cython "augmenting" declarations; see setup.py). Keep the
# fields equal to each class's __slots__; C types only where every assignment has that type.
cimport cython
from sidecar.engine.flow cimport ReadFlow
from sidecar.engine.head cimport locate
from sidecar.engine.idle_poll cimport IdlePoller

cdef class UpstreamConnection:
    cdef public UpstreamPool pool
    cdef public object transport, parser, ex, _poll
    cdef public ReadFlow flow
    cdef public list pieces
    cdef public Py_ssize_t piece_bytes, raw_at
    cdef public bint lost, counted, head_seen, done, keep_alive, reusable, eof_ends, write_paused, fresh
    cdef public double idle_since, stamp
    cdef public long relay
    cdef public list sink
    @cython.locals(pieces=list, raw=bytes, start=Py_ssize_t, first=Py_ssize_t, end=Py_ssize_t, status=long, body=long)
    cpdef on_headers_complete(self)

cdef class UpstreamPool:
    cdef public object loop, host, tls, server_hostname, idle, waiters, tasks
    cdef public long port, limit, total
    cdef public Py_ssize_t max_head
    cdef public bint closed
    cdef public IdlePoller poller
