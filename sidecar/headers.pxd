# Compiled layout of headers.py (Cython "augmenting" declarations; see setup.py): the field-value
# check runs on every request that carries an id or gets headers from its mode, from compiled callers;
# the header view is the base of the fast engine's HeaderBlock (engine/head.pxd).
cimport cython

cdef class HeaderView:
    cpdef get(self, key, default=*)

@cython.locals(view=HeaderView)
cpdef lookup(headers, name)
cpdef bint is_field_value(str value) except -1
