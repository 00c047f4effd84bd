# Compiled layout of fast_connection.py (Cython "augmenting" declarations; see setup.py). Keep
# the fields equal to ClientConnection.__slots__ (its base's are in fast_exchange.pxd).
cimport cython
from sidecar.engine.fast_exchange cimport ClientSide, Exchange, Shared, new_exchange
from sidecar.engine.flow cimport ReadFlow
from sidecar.engine.head cimport scan_request
from sidecar.engine.request_rules cimport plain
from sidecar.engine.relay cimport ClientOutput

cdef tuple _SPECIAL
# Read per request: C globals, not module-dict lookups (see fast_exchange.pxd).
cdef long LISTED, QUEUED, DONE, ABORT, CLOSE, PIPELINED
cdef object perf_counter
cdef Py_ssize_t _MAX_PIPELINED

cdef class ClientConnection(ClientSide):
    cdef public object clients, parser, transport, queue, timer
    cdef public Exchange cur
    cdef public bint stopped, closing, advancing
    cdef public Py_ssize_t max_head
    cdef public double idle_since, head_since, head_timeout
    @cython.locals(ex=Exchange)
    cpdef advance(self)
    cpdef finish_exchange(self, Exchange ex, long close)
    cpdef watch(self, double due, double now)
    cpdef flush(self)
    cpdef pause(self, long reason)
    @cython.locals(ex=Exchange, waits=bint, facts=long)
    cpdef on_head(self, bytes raw, Py_ssize_t first, Py_ssize_t end, bytes method, bytes target, long version,
                  bint keep_alive, length)
    @cython.locals(ex=Exchange)
    cpdef on_body(self, bytes body)
    @cython.locals(ex=Exchange)
    cpdef on_message_complete(self)
