# Declarations of _direct_reads.pyx (compiled build only), for the modules that call it at C level.
from sidecar.engine.idle_poll cimport IdlePoller
from sidecar.engine.relay cimport BodyRelay

cdef class Enrolled:
    cdef int fd
    cdef object conn
    cdef BodyRelay relay
    cdef bint gone

cdef class DirectReads:
    cdef int epfd, gate, tfd
    cdef long long batch_ns, last_wake, carried
    cdef readonly bint batching
    cdef object loop
    cdef IdlePoller poller
    cdef set live
    cdef list left
    cdef bint busy
    cdef unsigned char *buf
    cdef public unsigned long long enrolled, reads, batched
    cpdef Enrolled enroll(self, object conn, int fd, object relay)
    cpdef leave(self, Enrolled entry, int fd)
    cdef int _read_ready(self)
    cdef void _close_fds(self) noexcept
    cdef int _gate_ctl(self, int op, int fd) noexcept
    cdef int _arm(self, long long ns) noexcept
    cdef bint _slow(self, int n, long long dt) noexcept
    cdef void _stop(self) noexcept
    cdef void _pace(self, int n) noexcept
