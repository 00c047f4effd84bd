# Compiled layout of nvext.py (Cython "augmenting" declarations; see setup.py).
from sidecar.modes.context cimport RoutingContext

cpdef session_control(bint tree, bint bind, timeout, RoutingContext ctx)
cpdef dict with_control(dict body, dict control)
