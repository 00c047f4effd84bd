# Compiled layout of fast_exchange.py (docs/architecture.md, "Compiled and pure-Python builds"):
# C types only where every assignment has that type (lengths and limits stay Python ints: a client
# may declare any Content-Length).
cimport cython
from sidecar.engine.flow cimport ReadFlow
from sidecar.engine.fast_upstream cimport UpstreamConnection, UpstreamPool, UpstreamRequest
from sidecar.engine.idle_poll cimport IdlePoller
from sidecar.engine.relay cimport BodyRelay, ClientOutput
from sidecar.engine.request_rules cimport lone_chunked
from sidecar.engine.head cimport (HeaderBlock, copy_block, cut, decimal, first_value, has_header, header_map,
                                  header_values, name_table, reason_phrase, relay_block)
from sidecar.metrics cimport DeploymentStats, _Value
from sidecar.deployments cimport Deployment
from sidecar.router cimport Admission, Decision, RequestHead, Router
from sidecar.usage cimport Usage, UsageReader

cdef class Exchange(UpstreamRequest)

cdef dict _ADD_NAMES
# The module constants the per-request paths read, as C globals: a module global is a dict
# lookup at each read (not cached from Python 3.12 on). Private to this module once compiled:
# what other modules need comes from where it is defined (sidecar.engine.phases, wire, flow, head,
# relay).
cdef object perf_counter, _COMPLETED, _UPSTREAM_FAILED, _CLIENT_ABORTED
cdef long QUEUED, LOADING, BUFFERING, TRANSFORMING, CONNECTING, SENDING, SENT, DONE, KEEP, CLOSE, ABORT
cdef long PEER_FULL, WAITING, _IDLE_CHECKS, READY, LOAD, BODY, WORK, REFUSED
cdef long NAMES_HEADERS, HAS_CONTENT_LENGTH, HAS_TRANSFER_ENCODING, _FRAMING, LENGTH, CHUNKED, DECHUNK, EOF_RAW
cdef long EOF_CHUNKED
cdef Py_ssize_t WAIT_BUFFER, _SEPARATE_WRITE
cdef double _INF
cdef bytes CHUNKED_LINE, CL_LINE, CL_ZERO, CLOSE_LINE, CONNECTION_B, CONTINUE, HTTP10, HTTP11, KEEPALIVE_LINE
cdef bytes LAST_CHUNK, TRANSFER_ENCODING_B
cdef frozenset NO_EMPTY_LENGTH
cdef dict METHODS, STATUS_CODE

cdef class EngineState:
    cdef public object engine, health, drained
    cdef public Router router
    cdef public dict upstreams, drops
    cdef public _Value gauge
    cdef public long in_flight
    cdef public bint draining
    cdef public IdlePoller poller
    cpdef request_started(self)
    cpdef request_done(self)

cdef class ClientBase:
    cdef public EngineState shared
    cdef public object loop, peer, xff_xfp
    cdef public ClientOutput output
    cdef public ReadFlow flow
    cdef public bint write_paused
    cdef public double timer_due
    cpdef retired(self, Exchange ex, long close)
    cpdef arm_watchdog(self, double due, double now)
    cpdef flush(self)
    cpdef pause(self, long reason)

cdef class Exchange(UpstreamRequest):
    # connection
    cdef public ClientBase client
    cdef public EngineState shared
    cdef public long phase
    # request head
    cdef public bytes method, target, raw
    cdef public Py_ssize_t block_start, block_end
    cdef public bint slow_headers, http10, keep_alive, expect
    cdef public object conn_tokens, error
    # request body
    cdef public object length, limit
    cdef public bint chunked, complete
    cdef public list body
    cdef public Py_ssize_t body_size
    # routing
    cdef public Admission admission
    cdef public Decision decision
    # upstream
    cdef public UpstreamConnection conn
    cdef public UpstreamPool waiting_pool
    cdef public list upstream_head
    cdef public bint frame_chunked
    # timing
    cdef public double t0, connect_timeout, first_byte_timeout, idle_timeout, last_io
    cdef public unsigned long seen_reads
    # response
    cdef public long resp_status
    cdef public HeaderBlock resp_head
    cdef public double head_at
    cdef public bint close_after, reads_id
    cdef public UsageReader usage
    cpdef setup(self, ClientBase client, bytes raw, Py_ssize_t block_start, Py_ssize_t block_end, bytes method,
                bytes target, bint keep_alive, length)
    @cython.locals(shared=EngineState)
    cpdef start(self)
    @cython.locals(adm=Admission, decision=Decision, dep=Deployment, need=long)
    cpdef _next(self)
    @cython.locals(adm=Admission)
    cpdef _wait(self, long need)
    @cython.locals(client=ClientBase, shared=EngineState, conn=UpstreamConnection, pool=UpstreamPool, now=double,
                   due=double, stats=DeploymentStats, dep=Deployment, raw=bytes, entry=tuple, drops=dict, lines=list)
    cpdef _forward(self, Decision decision, length)
    @cython.locals(complete=bint)
    cpdef _send(self, UpstreamConnection conn, list parts)
    cpdef _whole_body(self)
    cpdef pump(self)
    @cython.locals(client=ClientBase, conn=UpstreamConnection, output=ClientOutput, out=list, base=Py_ssize_t,
                   mark=Py_ssize_t, framing=long, mode=long, http10=bint, adm=Admission, framed=bint)
    cpdef response_head(self, long status, bytes raw, Py_ssize_t start, Py_ssize_t first, Py_ssize_t end,
                        length, double now)
    @cython.locals(shared=EngineState, stats=DeploymentStats, decision=Decision, headers=HeaderBlock, adm=Admission)
    cpdef head_sent(self)
    @cython.locals(adm=Admission, done=bint)
    cpdef bint response_start(self, bytes data, bint chunked) except -1
    @cython.locals(stats=DeploymentStats, decision=Decision, adm=Admission)
    cpdef response_complete(self, double now)
    @cython.locals(conn=UpstreamConnection, phase=long)
    cpdef double deadline(self, double now) except? -1.0
    @cython.locals(adm=Admission, usage=UsageReader, conn=UpstreamConnection, found=Usage)
    cpdef _finish_admission(self, outcome)
    @cython.locals(conn=UpstreamConnection)
    cpdef _retire(self, long close)

@cython.locals(ex=Exchange)
cpdef Exchange new_exchange(ClientBase client, bytes raw, Py_ssize_t first, Py_ssize_t end, bytes method,
                            bytes target, bint keep_alive, length)
