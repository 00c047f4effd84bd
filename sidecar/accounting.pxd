# Compiled layout of accounting.py (see setup.py): the counters as an extension type (keep its
# fields equal to what Accounting.__init__ assigns); a response is counted on the event loop.
cimport cython
from sidecar.usage cimport Usage

cdef class Accounting:
    cdef public frozenset _accounted, _injected
    cdef public object _metrics, _clock
    cdef public dict _tokens, _responses
    cdef public list _slots
    cpdef bint accounts(self, str deployment) except -1
    cpdef bint injects(self, str deployment) except -1
    @cython.locals(slot=list, bucket=long, tokens=tuple)
    cpdef count(self, str deployment, str mode, long turn, Usage usage)
    @cython.locals(now=double, number=long, slot=list)
    cpdef list _slot(self)

cdef long _SLOTS, _B
cdef double _SLOT_SECONDS

cpdef long turn_bucket(long turn)
