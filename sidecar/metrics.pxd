# Compiled layout of metrics.py (Cython "augmenting" declarations; see setup.py): the hot-path
# children as extension types. Keep the fields equal to each class's __slots__.
cimport cython

cdef class _Value:
    cdef public double value
    cpdef inc(self, double amount=*)
    cpdef dec(self, double amount=*)
    cpdef set(self, double value)

cdef class _Buckets:
    cdef public tuple bounds
    cdef public list counts
    cdef public double sum
    @cython.locals(bounds=tuple, n=Py_ssize_t, i=Py_ssize_t, bound=double)
    cpdef observe(self, double value)

cdef class DeploymentStats:
    cdef public _Buckets added, ttfb, duration
    cdef public _Value headers_injected, _rewritten
    cdef public tuple _rewrites
    cdef public object _requests
    cdef public dict _by_class
    cpdef _Value request(self, long status)
    cpdef _Value rewritten(self)
