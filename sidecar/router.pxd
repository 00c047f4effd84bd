# Compiled layout of router.py (docs/architecture.md, "Compiled and pure-Python builds"): the
# decision records and the router as extension types.
cimport cython
from sidecar.deployments cimport Deployment
from sidecar.identity cimport Identity, IdentityReader
from sidecar.lineage cimport SessionTree, Turn
from sidecar.context cimport BodyPatch, RoutingContext
from sidecar.headers cimport is_field_value, lookup
from sidecar.jsonbody cimport ScannedBody, splice
from sidecar.accounting cimport Accounting
from sidecar.usage cimport Usage

cdef class Router

cdef class RequestHead:
    cdef public object method
    cdef public object headers
    cdef public object target

cdef class Decision:
    cdef readonly Deployment deployment
    cdef readonly object upstream
    cdef readonly frozenset drop
    cdef readonly tuple add
    cdef readonly object ctx
    cdef readonly object max_body_bytes
    cdef readonly object body

cdef class Admission:
    cdef public Router router
    cdef public RequestHead head
    cdef public Deployment deployment
    cdef public object request_id
    cdef public long need
    cdef public object limit
    cdef public Decision decision
    cdef public object error, reason, identity, work, selected
    cdef public long status
    cdef public Turn turn
    cdef public object api_session
    cdef public bint finished, reads_response_id
    cdef public object first_bytes, read
    cdef public long step
    cpdef loaded(self)
    cpdef body(self, data, size)
    cpdef worked(self, result)
    cpdef too_large(self)
    @cython.locals(router=Router, dep=Deployment, decision=Decision, turn=Turn)
    cpdef on_response(self, long status, headers)
    cpdef bint reads_response(self, long status, headers) except -1
    @cython.locals(decision=Decision)
    cpdef bint response_start(self, bytes data, bint chunked) except -1
    @cython.locals(turn=Turn, decision=Decision, router=Router, dep=Deployment)
    cpdef usage_reader(self, long status, headers, bint chunked)
    @cython.locals(turn=Turn, decision=Decision)
    cpdef on_usage(self, Usage usage)
    @cython.locals(turn=Turn)
    cpdef finish(self, outcome)
    cpdef _ready(self, Decision decision)
    cpdef _wait(self, long need, Deployment deployment, limit, work)
    cpdef _refuse(self, exc, reason)

cdef class Router:
    cdef public object config, metrics, deployments, _by_name, _by_model, _selection_body_limit, store
    cdef public object state
    cdef public Accounting accounting
    cdef public int _scan_depth
    cdef public tuple _top_names
    cdef public set _patch_roots
    cdef public frozenset _patching
    cdef public IdentityReader identity
    cdef public Deployment default
    cdef public str _selector, _primary_session_header
    cdef public bint _route_by_model, _single, _body_identity, _shared, _injecting
    cdef public tuple _worker_headers
    cdef public dict _workers, _api_sessions
    cdef public SessionTree tree
    @cython.locals(adm=Admission)
    cpdef Admission admit(self, RequestHead head)
    cpdef _feed(self, Admission adm, long need, data, size)
    @cython.locals(ident=Identity, dep=Deployment, head=RequestHead, decision=Decision)
    cpdef _route(self, Admission adm, bint loaded)
    @cython.locals(decision=Decision)
    cpdef _body(self, Admission adm, data, size)
    @cython.locals(decision=Decision)
    cpdef _worked(self, Admission adm, result)
    cpdef tuple _read_body(self, Identity ident, headers, body)
    @cython.locals(ident=Identity, dep=Deployment, decision=Decision, scanned=ScannedBody)
    cpdef _admit_body(self, Admission adm, bint loaded)
    @cython.locals(dep=Deployment, fields=BodyPatch)
    cpdef _rewrite(self, Admission adm, Decision decision, ScannedBody scanned)
    cpdef bytes _spliced(self, Admission adm, Decision decision, tuple outcome)
    cpdef _check_session(self, Deployment dep, session, rec)
    cpdef _choose(self, session, rec, selected, model_dep)
    cpdef binding(self, session, rec=*)
    @cython.locals(turn=Turn, decision=Decision, add=tuple, ctx=RoutingContext)
    cpdef Decision _admit(self, Admission adm, Deployment dep, Identity ident, rec)
    cpdef _release(self, Turn turn, rec, outcome)
    cpdef _account(self, Deployment dep, Turn turn, Usage usage)
    cpdef _forward_body(self, Admission adm, Decision decision, bytes body)
    cpdef bint _asks_usage(self, Deployment dep, RequestHead head) except -1

cdef dict _LOG_CACHE, _ADDABLE
# Read per request: C globals, not module-dict lookups (a dict lookup at each read, not cached
# from Python 3.12 on).
cdef object log, DEBUG, _UPSTREAM_FAILED
cdef str _REQUEST_ID, _CONTENT_LENGTH, _CONTENT_ENCODING, _CONTENT_TYPE, _TRANSFER_ENCODING
cdef Py_ssize_t MAX_ADDABLE
cdef bint _debug_on() except -1
@cython.locals(decision=Decision)
cdef Decision _decision(Deployment dep, upstream, frozenset drop, ctx)
cpdef Decision _sessionless(Deployment dep)
cpdef bint _declares_body(RequestHead head) except -1
cpdef _check_added(tuple add)
