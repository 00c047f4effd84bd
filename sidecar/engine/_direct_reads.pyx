# cython: language_level=3
"""Response bodies read without the event loop's transport machinery (compiled build only;
:mod:`sidecar.engine.direct` says when it is used).

:class:`DirectReads` reads the response bodies of enrolled upstream connections from an epoll
set of its own, registered with the loop as one reader: one loop callback per wakeup, however
many streams have bytes, and per read one ``recv`` into a buffer of its own, fed to the
response's :class:`~sidecar.engine.relay.BodyRelay` from there (a read that passes through
whole goes to the client's socket without becoming a Python object). The connection is called
only when the body ends (``body_end``) or its framing is invalid (``invalid_body``), as its own
reads would call them. Anything but bytes (the peer's close, an error) hands the connection
back with ``direct_stop()``: its transport reads again and meets the close or error itself. An
enrolled connection's transport has reading paused, so the two never read the same socket.

Batching (``batch_us`` > 0, the ``stream_batch_us`` setting): a wakeup costs more than the
reads it serves, so while the set wakes the loop more often than every ``batch_us`` and its
streams are slow against it (:data:`SLOW`), it is taken out of the loop's sight and read by a
timer once per ``batch_us`` instead (see ``_pace``). The loop then watches ``gate``, an epoll set
holding the timer and, when not batching, the set.
"""

from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdlib cimport free, malloc
from posix.unistd cimport close

from sidecar.engine.relay cimport BodyRelay

from sidecar.engine.parse_errors import ParseError


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

cdef extern from "<sys/timerfd.h>" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec
    struct itimerspec:
        timespec it_interval
        timespec it_value
    int timerfd_create(int clockid, int flags)
    int timerfd_settime(int fd, int flags, const itimerspec *new_value, itimerspec *old_value)
    enum:
        TFD_NONBLOCK
        TFD_CLOEXEC

cdef extern from "<time.h>" nogil:
    int clock_gettime(int clk, timespec *tp)
    enum:
        CLOCK_MONOTONIC

cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    enum:
        MSG_DONTWAIT

cdef enum:
    # Bytes per read (the loop's own transports read up to 256 KiB).
    READ_SIZE = 262144
    # Events taken per wakeup (more stay ready: the epoll set is level-triggered, so the loop
    # wakes again at once).
    BATCH = 64
    # Batching starts and goes on only while the streams are slow against its interval: on
    # average this many intervals or more between two reads of one stream, so the wait it adds
    # stays within a tenth of a stream's own gaps (a fast stream, alone, is never batched).
    SLOW = 10


cdef class Enrolled:
    """One enrolled connection: what a read needs, found from the epoll event itself (``gone``:
    it left, and events already taken for it are skipped)."""


cdef class DirectReads:
    """The epoll set of enrolled upstream connections (see the module docstring).

    Each epoll event carries its :class:`Enrolled` entry's address; ``live`` holds the entries
    (the connection keeps its own, to leave with), and ``left`` those that left while a batch of
    events was being handled, until it ends: an entry stays alive while an event may still name it."""

    def __cinit__(self):
        self.epfd = -1
        self.gate = -1
        self.tfd = -1
        self.buf = NULL

    def __init__(self, loop, IdlePoller poller, long batch_us=0):
        self.poller = poller  # told of every read but the timer's, as the transports' reads tell it
        self.live = set()
        self.left = []
        self.busy = False
        self.enrolled = 0
        self.reads = 0
        self.batched = 0
        self.carried = 0
        self.batching = False
        self.batch_ns = batch_us * 1000
        self.last_wake = 0
        self.buf = <unsigned char *>malloc(READ_SIZE)
        if self.buf == NULL:
            raise MemoryError()
        self.epfd = epoll_create1(EPOLL_CLOEXEC)
        if self.epfd < 0:
            raise OSError(errno, "epoll_create1 failed")
        self.loop = loop
        if batch_us <= 0:
            loop.add_reader(self.epfd, self._ready)
            return
        # Batching: the loop watches ``gate``, which holds the timer and, while not batching,
        # the set itself (the timer is disarmed then, so only the set's bytes wake the loop).
        self.gate = epoll_create1(EPOLL_CLOEXEC)
        if self.gate < 0:
            raise OSError(errno, "epoll_create1 failed")
        self.tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
        if self.tfd < 0:
            raise OSError(errno, "timerfd_create failed")
        if self._gate_ctl(EPOLL_CTL_ADD, self.tfd) < 0 or self._gate_ctl(EPOLL_CTL_ADD, self.epfd) < 0:
            raise OSError(errno, "epoll_ctl failed")
        loop.add_reader(self.gate, self._ready)

    def __dealloc__(self):
        self._close_fds()
        free(self.buf)

    cdef void _close_fds(self) noexcept:
        if self.epfd >= 0:
            close(self.epfd)
        if self.gate >= 0:
            close(self.gate)
        if self.tfd >= 0:
            close(self.tfd)
        self.epfd = self.gate = self.tfd = -1

    def close(self):
        """Stop reading (the engine is closing; its connections are aborted)."""
        cdef Enrolled entry
        if self.epfd >= 0:
            self.loop.remove_reader(self.epfd if self.gate < 0 else self.gate)
            self._close_fds()
        for entry in self.live:
            entry.gone = True
        if self.busy:
            self.left.extend(self.live)
        self.live.clear()

    cpdef Enrolled enroll(self, object conn, int fd, object relay):
        """Read ``conn``'s socket ``fd`` here from now on, into its response's ``relay``: the
        entry to leave with, or None if it could not be added (the transport keeps reading it then)."""
        cdef epoll_event ev
        cdef Enrolled entry
        if self.epfd < 0:
            return None
        entry = Enrolled.__new__(Enrolled)
        entry.fd = fd
        entry.conn = conn
        entry.relay = relay
        ev.events = EPOLLIN | EPOLLRDHUP
        ev.data.ptr = <void *>entry
        if epoll_ctl(self.epfd, EPOLL_CTL_ADD, fd, &ev) < 0:
            return None
        self.live.add(entry)
        self.enrolled += 1
        return entry

    cpdef leave(self, Enrolled entry, int fd):
        """Stop reading the connection enrolled as ``entry``: its socket ``fd`` leaves the set
        (-1: the socket is closed or about to be, which takes it out of the set; its descriptor
        may already name another socket, which must stay in)."""
        if entry.gone:
            return
        entry.gone = True
        self.live.discard(entry)
        if self.busy:
            self.left.append(entry)
        if self.epfd >= 0 and fd >= 0:
            epoll_ctl(self.epfd, EPOLL_CTL_DEL, fd, NULL)

    def _ready(self):
        cdef int n
        if self.epfd < 0:
            return
        self.busy = True
        try:
            n = self._read_ready()
            if self.gate >= 0:
                self._pace(n)
        finally:
            self.busy = False
            if self.left:
                self.left.clear()

    cdef int _gate_ctl(self, int op, int fd) noexcept:
        cdef epoll_event ev
        ev.events = EPOLLIN
        ev.data.fd = fd
        return epoll_ctl(self.gate, op, fd, &ev)

    cdef int _arm(self, long long ns) noexcept:
        """Set the timer to expire once, ``ns`` from now (0: disarm). Either clears an expiry
        not yet read, so the timer wakes the loop once per arming."""
        cdef itimerspec spec
        spec.it_interval.tv_sec = 0
        spec.it_interval.tv_nsec = 0
        spec.it_value.tv_sec = ns // 1000000000
        spec.it_value.tv_nsec = ns % 1000000000
        return timerfd_settime(self.tfd, 0, &spec, NULL)

    cdef bint _slow(self, int n, long long dt) noexcept:
        """``n`` reads in ``dt`` ns, over the enrolled streams, leave each stream :data:`SLOW`
        intervals or more apart on average."""
        return len(self.live) * dt >= SLOW * self.batch_ns * n

    cdef void _stop(self) noexcept:
        """Stop batching: the set wakes the loop again (if it cannot be watched again, the timer
        goes on reading it)."""
        if self._gate_ctl(EPOLL_CTL_ADD, self.epfd) == 0:
            self._arm(0)
            self.batching = False
        else:
            self._arm(self.batch_ns)

    cdef void _pace(self, int n) noexcept:
        """After a wakeup that found ``n`` reads: start batching when two wakeups with bytes come
        closer together than the interval (a timer wakeup per interval is then never more than
        the set's own wakeups would be) while the streams are slow (:data:`SLOW`); go on while
        each interval finds bytes of slow streams; stop otherwise, and the set wakes the loop
        itself again. A wakeup that left events unread (a full batch) is followed at once."""
        cdef timespec ts
        cdef long long now, dt, got
        clock_gettime(CLOCK_MONOTONIC, &ts)
        now = ts.tv_sec * 1000000000LL + ts.tv_nsec
        dt = now - self.last_wake  # last_wake: the last wakeup that found reads
        if self.batching:
            self.batched += 1
            got = n + self.carried  # this interval's reads (a full batch's follow-up adds to them)
            self.carried = 0
            if got == 0 or not self._slow(got, dt):
                self._stop()
            elif n >= BATCH:  # more are ready: read them at once, as part of this interval
                if self._arm(1000) == 0:
                    self.carried = got
                    return  # (last_wake stays: the follow-up's reads are this interval's)
                self._stop()
            elif self._arm(self.batch_ns) < 0:
                self._stop()
        elif n > 0 and dt < self.batch_ns and self._slow(n, dt):
            if self._arm(self.batch_ns) == 0:
                if self._gate_ctl(EPOLL_CTL_DEL, self.epfd) == 0:
                    self.batching = True
                else:
                    self._arm(0)
        if n > 0:
            self.last_wake = now

    cdef int _read_ready(self):
        cdef epoll_event events[BATCH]
        cdef int n, i
        cdef Py_ssize_t got, used
        cdef Enrolled entry
        cdef BodyRelay relay
        n = epoll_wait(self.epfd, events, BATCH, 0)
        for i in range(n):
            entry = <Enrolled>events[i].data.ptr
            if entry.gone:  # left since the wait (an earlier connection's bytes ended it)
                continue
            got = recv(entry.fd, self.buf, READ_SIZE, MSG_DONTWAIT)
            if got > 0:
                self.reads += 1
                if not self.batching:  # the timer's reads are not events worth polling for
                    self.poller.note()
                relay = entry.relay
                try:
                    used = relay.feed_from(self.buf, got, None)
                except ParseError as exc:
                    entry.conn.invalid_body(exc)
                    continue
                except Exception as exc:  # a defect: it costs this response, as with a transport's read
                    self.loop.call_exception_handler(
                        {"message": "upstream data_received failed", "exception": exc, "protocol": entry.conn}
                    )
                    entry.conn._fail(f"response not relayed: {exc!r}")
                    continue
                if relay.done:
                    entry.conn.body_end(used < got)
            elif got == 0 or (errno != EAGAIN and errno != EINTR):  # (EWOULDBLOCK is EAGAIN on Linux)
                entry.conn.direct_stop()  # the close or the error is the transport's to meet
        return n
