# Compiled layout of context.py (Cython "augmenting" declarations; see setup.py). Keep the fields
# in the dataclass's order.
cdef class RoutingContext:
    cdef public object session
    cdef public object parent
    cdef public object root
    cdef public bint is_final_turn
    cdef public object is_parent_final
    cdef public bint is_tree_final
    cdef public long turn
    cdef public object deployment
    cdef public object mode_state

cdef class BodyPatch:
    cdef public object path
    cdef public object values
    cdef public object owned
