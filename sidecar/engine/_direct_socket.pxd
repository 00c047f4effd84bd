# Declarations of _direct_socket.pyx (compiled build only), for the modules that call it at C level.

cdef class DirectSocket:
    cdef readonly int fd
    cdef object transport, is_closing
    cdef bint queued
    cpdef bint has_input(self)
    cpdef write(self, bytes data)
    cpdef writev(self, list parts)
    cdef int send_buffer(self, const unsigned char *buf, Py_ssize_t n) except -1
    cdef int _send(self, const unsigned char *buf, Py_ssize_t n, object data) except -1
