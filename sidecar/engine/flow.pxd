# Compiled layout of flow.py (Cython "augmenting" declarations; see setup.py). Keep the fields
# equal to ReadFlow.__slots__.
cdef class ReadFlow:
    cdef public object transport
    cdef public long reasons
