# Compiled layout of usage.py (see setup.py): the reader as an extension type (keep its fields
# equal to UsageReader.__slots__) and the member search with typed locals (it runs once per
# accounted response, on the event loop).
cimport cython

from sidecar._usagescan cimport framing_may_cut_key, rfind_usage_key, scan_usage_object

cdef Py_ssize_t MAX_CANDIDATES, _QUICK_TRIES, _OBJECT_BYTES
cdef dict _RANK
cdef bint _COMPILED
cdef long long _counts[2]  # (the counts scan_usage_object read)

cdef class Usage:
    cdef readonly object outcome
    cdef readonly long long prompt_tokens, cached_tokens

cdef class UsageReader:
    cdef public bint chunked, stream
    cdef readonly bytes _head
    cdef bint _head_done
    cdef readonly object _tail
    cdef Py_ssize_t _end
    cpdef bint first(self, bytes data) except -1
    cpdef bint holds(self, Py_ssize_t end) except -1
    @cython.locals(tail=bytes)
    cpdef last(self, bytes data, Py_ssize_t end)
    @cython.locals(want=Py_ssize_t, n=Py_ssize_t, picked=list, window=bytes)
    cpdef last_reads(self, reads, Py_ssize_t end, Py_ssize_t extra=*)
    @cython.locals(head=bytes, tail=bytes, found=Usage, other=Usage)
    cpdef Usage result(self)
    cpdef Usage _find(self, bytes raw, bint at_start)

@cython.locals(pos=Py_ssize_t, _tried=Py_ssize_t, worst=Usage, found=Usage)
cpdef tuple _last_usage(bytes payload, bint at_start)

@cython.locals(slashes=Py_ssize_t, j=Py_ssize_t, i=Py_ssize_t, c=Py_ssize_t, limit=Py_ssize_t, end=Py_ssize_t,
               tries=Py_ssize_t, read=int)
cpdef _member(bytes payload, Py_ssize_t pos, bint at_start)

cpdef interpret(usage)
cpdef _with_details(prompt, details)

@cython.locals(n=Py_ssize_t, c=Py_ssize_t)
cpdef Py_ssize_t _skip_ws(bytes data, Py_ssize_t i)

cpdef Py_ssize_t _rfind_key(bytes payload, Py_ssize_t end)
cpdef bint _may_cut_key(bytes raw, Py_ssize_t start) except -1
