# Compiled layout of idle_poll.py (Cython "augmenting" declarations; see setup.py). Keep the
# fields equal to IdlePoller.__slots__.
cdef class IdlePoller:
    cdef public object loop, _tick_cb
    cdef public double window, last, busy_from, busy, polled, since, resume_at, total
    cdef public bint running, stopped
    cpdef note(self)
