# Compiled layout of fast.py (Cython "augmenting" declarations; see setup.py). Keep the fields
# equal to each class's __slots__; C types only where every assignment has that type (lengths
# and limits stay Python ints: a client may declare any Content-Length).
cimport cython
from sidecar.engine.flow cimport ReadFlow
from sidecar.engine.fast_client cimport UpstreamConnection
from sidecar.engine.idle_poll cimport IdlePoller
from sidecar.engine.head cimport (HeaderBlock, copy_block, first_value, has_header, header_map, scan_request,
                                  header_values, name_table, reason_phrase, relay_block)
from sidecar.metrics cimport DeploymentStats, _Value
from sidecar.deployments cimport Deployment
from sidecar.router cimport Decision, Router

cdef tuple _SPECIAL

cdef class _Shared:
    cdef public Router router
    cdef public dict upstreams, drops
    cdef public _Value gauge
    cdef public object health, drained
    cdef public long in_flight
    cdef public bint draining
    cdef public IdlePoller poller
    cpdef request_done(self)

cdef class _ClientConnection:
    cdef public object engine, loop, parser, transport, peer, xff_xfp, queue, timer
    cdef public _Shared shared
    cdef public ReadFlow flow
    cdef public _Exchange cur
    cdef public list out
    cdef public bint stopped, write_paused, closing, advancing
    cdef public Py_ssize_t max_head
    cdef public double idle_since, timer_due, head_since, head_timeout
    @cython.locals(ex=_Exchange)
    cpdef advance(self)
    cpdef flush(self)
    @cython.locals(ex=_Exchange, special=bint, waits=bint, facts=long)
    cpdef on_head(self, bytes raw, Py_ssize_t first, Py_ssize_t end, bytes method, bytes target, long version,
                  bint keep_alive, length)

cdef class _Exchange:
    cdef public _ClientConnection client
    cdef public bytes method, target, raw
    cdef public Py_ssize_t first, end
    cdef public object length, conn_tokens, error, limit
    cdef public Decision decision
    cdef public bint special, http10, keep_alive, chunked, expect, queued, complete, started
    cdef public bint frame_chunked, request_sent, resp_started, close_after
    cdef public list body, head
    cdef public Py_ssize_t body_size
    cdef public long state, resp_status, resp_mode
    cdef public double t0, connect_timeout, first_byte_timeout, idle_timeout, last_io, head_at
    cdef public HeaderBlock resp_head
    cdef public UpstreamConnection conn
    @cython.locals(client=_ClientConnection, shared=_Shared, router=Router)
    cpdef start(self)
    @cython.locals(client=_ClientConnection, router=Router, decision=Decision, dep=Deployment)
    cpdef _route(self, bint loaded)
    @cython.locals(client=_ClientConnection, shared=_Shared, conn=UpstreamConnection, now=double, due=double,
                   stats=DeploymentStats, dep=Deployment, raw=bytes, entry=tuple)
    cpdef _forward(self, Decision decision, length)
    cpdef _send(self, UpstreamConnection conn, list parts)
    cpdef _send_transformed(self)
    @cython.locals(client=_ClientConnection, conn=UpstreamConnection, out=list, mark=Py_ssize_t, framing=long)
    cpdef response_head(self, long status, bytes raw, Py_ssize_t start, Py_ssize_t first, Py_ssize_t end,
                        double now)
    @cython.locals(client=_ClientConnection, shared=_Shared, stats=DeploymentStats, decision=Decision, router=Router)
    cpdef response_end(self, double now)
    @cython.locals(shared=_Shared, stats=DeploymentStats, decision=Decision, router=Router, headers=HeaderBlock)
    cpdef _observe_head(self)
