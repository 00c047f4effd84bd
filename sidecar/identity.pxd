# Compiled layout of identity.py (docs/architecture.md, "Compiled and pure-Python builds").
cimport cython
from sidecar.headers cimport is_field_value, lookup

cdef class Identity:
    cdef public object session
    cdef public object parent
    cdef public object root
    cdef public bint final
    cdef public object response

# Returned for every request without a session: a C global, not a module-dict lookup.
cdef Identity NO_SESSION
# The client families and their header names, read per request: C globals.
cdef long _GENERIC, _CLAUDE_CODE, _CODEX
cdef str _CLAUDE_SESSION, _CLAUDE_AGENT, _CLAUDE_PARENT_AGENT, _CODEX_THREAD, _CODEX_ROOT, _CODEX_PARENT

@cython.locals(ident=Identity)
cdef Identity _identity(str session, parent, root, bint final)

cdef class IdentityReader:
    cdef public tuple _families, _session, _parent, _root, _final, _lineage, _body, body_keys
    cdef public bint _fingerprint, reads_body
    cdef public frozenset header_names
    cdef public Py_ssize_t _max_id_bytes, _fits
    cpdef str _bounded(self, str value)
    @cython.locals(family=long)
    cpdef Identity read(self, headers)
    cpdef Identity _with_session(self, headers, str session)
    cpdef Identity _claude_code(self, headers, str conversation)
    cpdef Identity _codex(self, headers, str thread)
    cpdef Identity _chained(self, headers, str previous)
    cpdef _value(self, headers, str name)
    cpdef bint _final_flag(self, headers) except -1
