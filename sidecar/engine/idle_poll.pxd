# Compiled layout of idle_poll.py (docs/architecture.md, "Compiled and pure-Python builds").
cdef class IdlePoller:
    cdef public object loop, _tick_cb
    cdef public double window, last, busy_from, busy, polled, since, resume_at, total
    cdef public bint running, stopped
    cpdef note(self)
