# Compiled layout of dynamo.py (Cython "augmenting" declarations; see setup.py): the modes'
# per-request hooks run as C rather than bytecode. The classes stay Python classes (modes
# subclass Mode); the nvext helper gets typed arguments.
from sidecar.context cimport BodyPatch, RoutingContext

# Read per request: C globals, not module-dict lookups (not cached from Python 3.12 on).
cdef str X_DYNAMO_SESSION_ID, X_DYNAMO_PARENT_SESSION_ID
cdef Py_ssize_t DYNAMO_ALWAYS_FITS, DYNAMO_MAX_ID_BYTES

cpdef session_control(bint tree, bint bind, timeout, RoutingContext ctx)
