# Compiled layout of fast_upstream.py (docs/architecture.md, "Compiled and pure-Python builds"):
# C types only where every assignment has that type.
cimport cython
from sidecar.engine._direct_reads cimport DirectReads, Enrolled
from sidecar.engine._direct_socket cimport DirectSocket
from sidecar.engine.flow cimport ReadFlow
from sidecar.engine.head cimport cut, head_end, locate
from sidecar.engine.idle_poll cimport IdlePoller
from sidecar.engine.relay cimport BodyRelay
from sidecar.usage cimport UsageReader

cdef unsigned long ENROLL_AFTER, _ENROLL_RETRY
cdef Py_ssize_t TAIL_READS, LAST_BYTES
# Read per request: C globals, not module-dict lookups (see fast_exchange.pxd).
cdef object perf_counter
cdef long CLIENT_FULL, DIRECT

cdef class UpstreamRequest:
    cpdef response_head(self, long status, bytes raw, Py_ssize_t start, Py_ssize_t first, Py_ssize_t end, length,
                        double now)
    cpdef head_sent(self)
    cpdef bint response_start(self, bytes data, bint chunked) except -1
    cpdef response_complete(self, double now)

cdef class UpstreamConnection:
    cdef public UpstreamPool pool
    cdef public UpstreamRequest ex
    cdef public object transport, parser, _poll
    cdef public ReadFlow flow
    cdef public list pieces
    cdef public Py_ssize_t raw_at, scan_at, fed
    cdef public bint lost, holds_slot, keep_alive, reusable, sent_all, write_paused, unanswered
    cdef public double idle_since
    cdef public BodyRelay relay
    cdef public Enrolled direct
    cdef public DirectSocket sock
    cdef public unsigned long enroll_at
    cdef public long first_bytes
    cdef public UsageReader usage
    cdef public list tail_reads
    cdef public Py_ssize_t tail_at, tail_seen, tail_extra
    @cython.locals(relay=BodyRelay)
    cpdef data_received(self, bytes data)
    @cython.locals(used=Py_ssize_t, direct=DirectReads, entry=Enrolled, usage=bint, reader=UsageReader, seen=Py_ssize_t,
                   reads=list, at=Py_ssize_t, k=Py_ssize_t)
    cpdef _body(self, BodyRelay relay, bytes data)
    cpdef body_end(self, Py_ssize_t extra)
    cpdef invalid_body(self, exc)
    cpdef bind(self, ex, bint client_paused)
    cpdef bint usable(self, double now) except -1
    cpdef send(self, list parts, bint last)
    @cython.locals(pieces=list, raw=bytes, max_head=Py_ssize_t, k=Py_ssize_t, at=Py_ssize_t, stop=Py_ssize_t, start=Py_ssize_t,
                   first=Py_ssize_t, end=Py_ssize_t, status=long, now=double, relay=BodyRelay)
    cpdef _head(self, bytes data)
    cpdef _complete(self, double now)
    cpdef _unbind(self)
    @cython.locals(entry=Enrolled)
    cpdef direct_stop(self)
    cpdef _thread_tail(self, tuple tail, Py_ssize_t extra)
    cpdef read_usage(self, UsageReader usage)
    @cython.locals(reads=list, at=Py_ssize_t)
    cpdef _reads_to_usage(self, Py_ssize_t extra)
    @cython.locals(entry=Enrolled)
    cpdef _usage_end(self)
    cpdef end_usage(self)
    @cython.locals(entry=Enrolled)
    cpdef client_gone(self)

cdef class UpstreamPool:
    cdef public object loop, host, tls, server_hostname, waiters, tasks
    cdef public list idle
    cdef public DirectReads direct
    cdef public long port, limit, total
    cdef public Py_ssize_t max_head
    cdef public bint closed
    cdef public IdlePoller poller
    @cython.locals(conn=UpstreamConnection, idle=list)
    cpdef take(self, double now)
    cpdef release(self, UpstreamConnection conn, double now)
