# cython: language_level=3
"""A connection's socket written without the event loop's transport machinery (compiled build
only; :mod:`sidecar.engine.direct` says when it is used).

:class:`DirectSocket` writes with one ``send`` (one gathering ``sendmsg`` for pieces) when its
transport has nothing buffered: all of the bytes sent, done; the rest, or all of them after
EAGAIN or an error, go to ``transport.write``, which buffers them or meets the error itself and
reports it as it always does. It never writes once the transport is closing: the descriptor is
the transport's, and is only known to be this connection's while the transport is open. It is
the transport's only writer, so it knows when the transport may hold bytes (after it handed it
some) and asks the transport's buffer size only then.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.errno cimport EAGAIN, EINTR, errno
from libc.string cimport memset
from posix.uio cimport iovec


cdef extern from "<sys/socket.h>" nogil:
    ssize_t send(int fd, const void *buf, size_t n, int flags)
    struct msghdr:
        iovec *msg_iov
        size_t msg_iovlen
    ssize_t sendmsg(int fd, const msghdr *msg, int flags)
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    enum:
        MSG_DONTWAIT
        MSG_NOSIGNAL
        MSG_PEEK

cdef enum:
    _MAX_PARTS = 64  # pieces one sendmsg gathers (a request or response head has a dozen or so)


cdef class DirectSocket:
    """A connection's socket, written directly while its transport has nothing buffered (see the
    module docstring: it must be the transport's only writer)."""

    def __init__(self, transport):
        self.transport = transport
        self.is_closing = transport.is_closing  # (bound once: it is asked on every write)
        self.fd = transport.get_extra_info("socket").fileno()
        self.queued = False

    cpdef bint has_input(self):
        """Whether the socket has bytes, a close or an error waiting to be read (one non-blocking
        ``MSG_PEEK`` recv, which takes nothing). Ask only while the transport is open."""
        cdef char c
        if recv(self.fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) >= 0:
            return True
        return errno != EAGAIN and errno != EINTR

    cpdef write(self, bytes data):
        """Write all of ``data``: now, as far as the socket takes it; the rest through the transport."""
        self._send(<const unsigned char *>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), data)

    cpdef writev(self, list parts):
        """Write the bytes objects ``parts``, in order, as :meth:`write` writes their join: when
        nothing is queued, one ``sendmsg`` gathers them from where they are (no joined copy, no
        allocation); what the socket does not take goes to the transport, joined."""
        cdef iovec iov[_MAX_PARTS]
        cdef msghdr msg
        cdef Py_ssize_t n = len(parts), i, total = 0, sent = 0
        if n == 1 and type(parts[0]) is bytes:  # nothing to gather
            self.write(parts[0])
            return
        if n > _MAX_PARTS:
            self.write(b"".join(parts))
            return
        for i in range(n):
            part = parts[i]
            if type(part) is not bytes:
                self.write(b"".join(parts))
                return
            iov[i].iov_base = PyBytes_AS_STRING(part)
            iov[i].iov_len = PyBytes_GET_SIZE(part)
            total += PyBytes_GET_SIZE(part)
        transport = self.transport
        if self.queued:  # bytes went to the transport: they leave first
            if transport.get_write_buffer_size():
                transport.write(b"".join(parts))
                return
            self.queued = False
        if not self.is_closing():
            memset(&msg, 0, sizeof(msg))
            msg.msg_iov = iov
            msg.msg_iovlen = n
            sent = sendmsg(self.fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL)
            if sent == total:
                return
            if sent < 0:  # EAGAIN, or an error the transport will meet and report
                sent = 0
        self.queued = True
        rest = b"".join(parts)
        transport.write(rest if sent == 0 else rest[sent:])

    cdef int send_buffer(self, const unsigned char *buf, Py_ssize_t n) except -1:
        """Write ``buf[:n]`` as :meth:`write` does: a bytes object is made only for what the
        socket does not take at once."""
        return self._send(buf, n, None)

    cdef int _send(self, const unsigned char *buf, Py_ssize_t n, object data) except -1:
        cdef Py_ssize_t sent = 0
        transport = self.transport
        if self.queued:  # bytes went to the transport: they leave first
            if transport.get_write_buffer_size():
                transport.write(buf[:n] if data is None else data)
                return 0
            self.queued = False
        if not self.is_closing():
            sent = send(self.fd, buf, n, MSG_DONTWAIT | MSG_NOSIGNAL)
            if sent == n:
                return 0
            if sent < 0:  # EAGAIN, or an error the transport will meet and report
                sent = 0
        self.queued = True
        transport.write(data if sent == 0 and data is not None else buf[sent:n])
        return 0
