# Compiled layout of flow.py (Cython "augmenting" declarations; see setup.py). Keep the fields
# equal to ReadFlow.__slots__. The methods are cpdef: the engine's modules call them in C, once
# or more per request.
cdef class ReadFlow:
    cdef public object transport
    cdef public long reasons
    cpdef pause(self, long reason)
    cpdef resume(self, long reason)
    cpdef clear(self)
