# Declarations of _direct.pyx (compiled build only), for the modules that call it at C level.

cdef class DirectSocket:
    cdef readonly int fd
    cdef object transport
    cpdef write(self, bytes data)

cdef class DirectReads:
    cdef int epfd
    cdef object loop
    cdef dict conns
    cdef unsigned long long serial
    cdef char *buf
    cdef public unsigned long long enrolled, reads
    cpdef unsigned long long enroll(self, object conn, int fd) except? 0
    cpdef leave(self, unsigned long long key, int fd)
