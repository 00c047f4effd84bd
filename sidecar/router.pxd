# Compiled layout of router.py (Cython "augmenting" declarations; see setup.py): the decision
# records and the router as extension types. Keep the records' fields in their dataclass order
# and Router's equal to the attributes its __init__ sets.
cimport cython
from sidecar.deployments cimport Deployment
from sidecar.identity cimport Identity, IdentityReader
from sidecar.lineage cimport SessionTree, Turn
from sidecar.context cimport BodyPatch, RoutingContext
from sidecar.headers cimport is_field_value, lookup
from sidecar.jsonbody cimport ScannedBody, splice

cdef class RequestHead:
    cdef public object method
    cdef public object headers

cdef class _Pending:
    cdef public Identity ident
    cdef public object headers
    cdef public object selected
    cdef public object decided

cdef class _Admission:
    cdef public Turn turn
    cdef public object api_session

cdef class Decision:
    cdef public Deployment deployment
    cdef public object upstream
    cdef public frozenset drop
    cdef public tuple add
    cdef public bint needs_body
    cdef public object ctx
    cdef public object max_body_bytes
    cdef public object request_id
    cdef public object body
    cdef public long status
    cdef public object _held
    cdef public bint reads_response_id
    cdef public object first_bytes

cdef class Router:
    cdef public object config, metrics, deployments, _by_name, _by_model, _selection_body_limit, store, effects
    cdef public object state
    cdef public int _scan_depth
    cdef public tuple _top_names
    cdef public set _patch_roots
    cdef public frozenset _patching
    cdef public IdentityReader identity
    cdef public Deployment default
    cdef public str _selector, _primary_session_header
    cdef public bint _route_by_model, _single, _body_identity, _shared
    cdef public tuple _worker_headers
    cdef public dict _workers, _api_sessions
    cdef public SessionTree tree
    @cython.locals(ident=Identity, dep=Deployment)
    cpdef Decision route(self, RequestHead head, bint loaded=*)
    cpdef transform_body(self, Decision decision, body, size)
    @cython.locals(ident=Identity)
    cpdef tuple _read_body(self, _Pending pending, body)
    @cython.locals(ident=Identity, dep=Deployment, admitted=Decision, scanned=ScannedBody)
    cpdef _admit_body(self, Decision decision, _Pending pending, tuple read, bint loaded=*)
    @cython.locals(dep=Deployment, fields=BodyPatch)
    cpdef _rewrite(self, Decision decision, ScannedBody scanned)
    cpdef _completed(self, Decision admitted, result)
    cpdef bytes _spliced(self, Decision decision, tuple outcome)
    cpdef _check_session(self, Deployment dep, session, rec)
    cpdef _choose(self, session, rec, selected, model_dep)
    cpdef binding(self, session, rec=*)
    @cython.locals(turn=Turn, decision=Decision, add=tuple, ctx=RoutingContext)
    cpdef Decision _admit(self, Deployment dep, Identity ident, headers, rec, request_id)
    @cython.locals(turn=Turn, dep=Deployment)
    cpdef on_response(self, Decision decision, long status, headers)
    cpdef finish(self, Decision decision, outcome)
    @cython.locals(turn=Turn)
    cpdef _release(self, _Admission held, outcome)

cdef dict _LOG_CACHE, _ADDABLE
# Read per request: C globals, not module-dict lookups (a dict lookup at each read, not cached
# from Python 3.12 on).
cdef object log, DEBUG
cdef str _REQUEST_ID, _CONTENT_LENGTH, _CONTENT_ENCODING, _TRANSFER_ENCODING
cdef Py_ssize_t MAX_ADDABLE
cdef bint _debug_on() except -1
@cython.locals(decision=Decision)
cdef Decision _decision(Deployment dep, upstream, frozenset drop, bint needs_body, ctx, limit, request_id, held)
cpdef Decision _sessionless(Deployment dep, request_id)
cpdef bint _declares_body(RequestHead head) except -1
cpdef Decision _awaiting_body(Deployment dep, limit, _Pending pending, request_id)
@cython.locals(admission=_Admission)
cpdef Decision _admitted(Deployment dep, upstream, RoutingContext ctx, Turn turn, rec, request_id)
cpdef _check_added(tuple add)
