# Compiled layout of dynamo.py (Cython "augmenting" declarations; see setup.py): the modes'
# per-request hooks run as C rather than bytecode. The classes stay Python classes (modes
# subclass Mode); the nvext helper gets typed arguments.
from sidecar.context cimport BodyPatch, RoutingContext

cpdef session_control(bint tree, bint bind, timeout, RoutingContext ctx)
