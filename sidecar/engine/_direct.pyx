# cython: language_level=3
"""Socket I/O of streamed bodies without the event loop's transport machinery (compiled build
only; :mod:`sidecar.engine.direct` says when each is used).

:class:`DirectSocket` writes a client's bytes with one ``send`` when its transport has nothing
buffered (all of them sent: done; the rest, or all of them after EAGAIN or an error, go to
``transport.write``, which buffers them or meets the error itself and reports it as it always
does). It never writes once the transport is closing: the descriptor is the transport's, and
is only known to be this connection's while the transport is open.

:class:`DirectReads` reads the response bodies of enrolled upstream connections from an epoll
set of its own, registered with the loop as one reader: one loop callback per wakeup, however
many streams have bytes, and per read one ``recv`` into a buffer of its own, handed to the
connection's ``data_received`` as the transport would. Anything but bytes (the peer's close,
an error) hands the connection back with ``direct_stop()``: its transport reads again and
meets the close or error itself. An enrolled connection's transport has reading paused, so
the two never read the same socket.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdlib cimport free, malloc
from posix.unistd cimport close


cdef extern from "<sys/epoll.h>" nogil:
    ctypedef union epoll_data_t:
        void *ptr
        int fd
        unsigned int u32
        unsigned long long u64
    struct epoll_event:
        unsigned int events
        epoll_data_t data
    int epoll_create1(int flags)
    int epoll_ctl(int epfd, int op, int fd, epoll_event *event)
    int epoll_wait(int epfd, epoll_event *events, int maxevents, int timeout)
    enum:
        EPOLL_CTL_ADD
        EPOLL_CTL_DEL
        EPOLLIN
        EPOLLRDHUP
        EPOLL_CLOEXEC

cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    ssize_t send(int fd, const void *buf, size_t n, int flags)
    enum:
        MSG_DONTWAIT
        MSG_NOSIGNAL

cdef enum:
    # Bytes per read (the loop's own transports read up to 256 KiB).
    READ_SIZE = 262144
    # Events taken per wakeup (more stay ready: the epoll set is level-triggered, so the loop
    # wakes again at once).
    BATCH = 64


cdef class DirectSocket:
    """A connection's socket, written directly while its transport has nothing buffered."""

    def __init__(self, transport):
        self.transport = transport
        self.fd = transport.get_extra_info("socket").fileno()

    cpdef write(self, bytes data):
        """Write all of ``data``: now, as far as the socket takes it; the rest through the transport."""
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
        cdef Py_ssize_t sent
        transport = self.transport
        if not transport.is_closing() and not transport.get_write_buffer_size():
            sent = send(self.fd, PyBytes_AS_STRING(data), n, MSG_DONTWAIT | MSG_NOSIGNAL)
            if sent == n:
                return
            if sent > 0:
                data = data[sent:]
        transport.write(data)


cdef class DirectReads:
    """The epoll set of enrolled upstream connections (see the module docstring)."""

    def __cinit__(self):
        self.epfd = -1
        self.buf = NULL

    def __init__(self, loop):
        self.conns = {}
        self.serial = 0
        self.enrolled = 0
        self.reads = 0
        self.buf = <char *>malloc(READ_SIZE)
        if self.buf == NULL:
            raise MemoryError()
        self.epfd = epoll_create1(EPOLL_CLOEXEC)
        if self.epfd < 0:
            raise OSError(errno, "epoll_create1 failed")
        self.loop = loop
        loop.add_reader(self.epfd, self._ready)

    def __dealloc__(self):
        if self.epfd >= 0:
            close(self.epfd)
        free(self.buf)

    def close(self):
        """Stop reading (the engine is closing; its connections are aborted)."""
        if self.epfd >= 0:
            self.loop.remove_reader(self.epfd)
            close(self.epfd)
            self.epfd = -1
        self.conns.clear()

    cpdef unsigned long long enroll(self, object conn, int fd) except? 0:
        """Read ``conn``'s socket ``fd`` here from now on: the key to leave with, or 0 if it
        could not be added (the transport keeps reading it then)."""
        cdef epoll_event ev
        if self.epfd < 0:
            return 0
        self.serial += 1
        ev.events = EPOLLIN | EPOLLRDHUP
        ev.data.u64 = self.serial
        if epoll_ctl(self.epfd, EPOLL_CTL_ADD, fd, &ev) < 0:
            return 0
        self.conns[self.serial] = (fd, conn.data_received, conn)
        self.enrolled += 1
        return self.serial

    cpdef leave(self, unsigned long long key, int fd):
        """Stop reading the connection enrolled under ``key``: its socket ``fd`` leaves the set
        (-1: the socket is closed or about to be, which takes it out of the set; its descriptor
        may already name another socket, which must stay in)."""
        if self.conns.pop(key, None) is not None and self.epfd >= 0 and fd >= 0:
            epoll_ctl(self.epfd, EPOLL_CTL_DEL, fd, NULL)

    def _ready(self):
        cdef epoll_event events[BATCH]
        cdef int n, i, fd
        cdef Py_ssize_t got
        if self.epfd < 0:
            return
        n = epoll_wait(self.epfd, events, BATCH, 0)
        conns = self.conns
        for i in range(n):
            entry = conns.get(events[i].data.u64)
            if entry is None:  # left since the wait (an earlier connection's bytes ended it)
                continue
            fd = entry[0]
            got = recv(fd, self.buf, READ_SIZE, MSG_DONTWAIT)
            if got > 0:
                self.reads += 1
                try:
                    entry[1](PyBytes_FromStringAndSize(self.buf, got))
                except Exception as exc:  # a defect: it costs this response, as with a transport's read
                    self.loop.call_exception_handler(
                        {"message": "upstream data_received failed", "exception": exc, "protocol": entry[2]}
                    )
                    entry[2]._fail(f"response not relayed: {exc!r}")
            elif got == 0 or (errno != EAGAIN and errno != EINTR):  # (EWOULDBLOCK is EAGAIN on Linux)
                entry[2].direct_stop()  # the close or the error is the transport's to meet
