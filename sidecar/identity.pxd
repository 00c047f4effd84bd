# Compiled layout of identity.py (Cython "augmenting" declarations; see setup.py). Keep
# Identity's fields in its dataclass order and IdentityReader's equal to its __slots__.
cimport cython
from sidecar.engine.head cimport lookup
from sidecar.headers cimport is_field_value

cdef class Identity:
    cdef public object session
    cdef public object parent
    cdef public object root
    cdef public bint final

# Returned for every request without a session: a C global, not a module-dict lookup.
cdef Identity NO_SESSION

@cython.locals(ident=Identity)
cdef Identity _identity(str session, parent, root, bint final)

cdef class IdentityReader:
    cdef public tuple _session, _parent, _root, _final, _lineage, _body, body_keys
    cdef public bint _fingerprint, reads_body
    cdef public frozenset header_names
    cdef public Py_ssize_t _max_id_bytes, _fits
    cpdef str _bounded(self, str value)
    cpdef Identity read(self, headers)
    cpdef Identity _with_session(self, headers, str session)
