# Compiled layout of fast_connection.py (docs/architecture.md, "Compiled and pure-Python builds").
cimport cython
from sidecar.engine.fast_exchange cimport ClientBase, Exchange, EngineState, new_exchange
from sidecar.engine.flow cimport ReadFlow
from sidecar.engine.head cimport scan_request
from sidecar.engine.request_rules cimport plain
from sidecar.engine.relay cimport ClientOutput

cdef tuple _SLOW_HEADERS
# Read per request: C globals, not module-dict lookups (see fast_exchange.pxd).
cdef long LISTED, QUEUED, DONE, ABORT, CLOSE, PIPELINED, READING, ANSWERING, CLOSED
cdef object perf_counter
cdef Py_ssize_t _MAX_PIPELINED

cdef class ClientConnection(ClientBase):
    cdef public object clients, parser, transport, queue, timer
    cdef public Exchange parsing
    cdef public long lifecycle
    cdef public bint advancing
    cdef public Py_ssize_t max_head
    cdef public double idle_since, head_since, head_timeout
    @cython.locals(ex=Exchange)
    cpdef advance(self)
    cpdef retired(self, Exchange ex, long close)
    cpdef arm_watchdog(self, double due, double now)
    cpdef flush(self)
    cpdef pause(self, long reason)
    @cython.locals(ex=Exchange, waits=bint, head_bits=long)
    cpdef on_head(self, bytes raw, Py_ssize_t first, Py_ssize_t end, bytes method, bytes target, long version,
                  bint keep_alive, length)
    @cython.locals(ex=Exchange)
    cpdef on_body(self, bytes body)
    @cython.locals(ex=Exchange)
    cpdef on_message_complete(self)
