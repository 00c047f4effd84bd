# cython: language_level=3
"""Streamed response bodies relayed by a thread of the engine's own, without Python (compiled
build only; :mod:`sidecar.engine.direct` says when it is used).

:class:`DirectReads` owns an epoll set and one thread that waits on it with no Python state and
no GIL. For each enrolled upstream connection the thread reads the socket and, when the read is
one the relay would pass through unchanged (whole chunks of a chunked body; bytes within a
Content-Length body; a close-delimited body to an HTTP/1.0 client), sends it to the client's
socket at once: per event one ``epoll_wait``, one ``recv`` and one ``send``, the loop never
woken. The read that ends the body the usual way (whole chunks then the last chunk with no
extension or trailer, ending the read; the last bytes of a Content-Length body) is sent the
same way, then handed back (``K_END``) for the loop to end the response; a loop that learns of
the client's close before that note (a client that closes once it has the last byte) acts on
the note first (:meth:`DirectReads.settle`): a body delivered whole is complete. Every other read is
handed back to the loop whole (``K_READ``), which feeds it to the response's
:class:`~sidecar.engine.relay.BodyRelay` as its transport's reads are fed (trailers,
extensions, bytes after the body, invalid framing all stay in one place), then enrols the
connection again if its body goes on at a chunk boundary. A client socket that takes only part
of a read hands the rest back (``K_FULL``: written through the client's transport, which then
applies backpressure as always); a close or an error on the upstream socket hands the
connection back to its transport (``K_STOP``), which meets a close itself. An error (a reset) the
thread's read has already taken from the socket: the transport would read only a clean close
after it, which ends a body delimited by the close as if it were complete, so the note carries
the error and the loop fails the response with it, as the transport would have.

Usage. For a response whose prompt-cache usage is read (:mod:`sidecar.usage`), the entry is
enrolled with ``tail``: the thread also copies each read it takes into the entry's ring of its
last ``TAIL_BYTES`` bytes and counts them; :meth:`DirectReads.leave` returns both, for the loop
to show the usage reader the body's last bytes. A copy per read on the thread, nothing on the
loop.

Thread safety. The thread uses descriptors of its own (``dup``), so a socket the loop closes is
never confused with another that reuses its number. Each entry has a lock the thread holds
while it reads and sends for it; :meth:`DirectReads.leave` marks the entry gone under that lock,
so once it returns the thread never touches that connection again. An entry handed back is out
of the epoll set (``held``) until the loop enrols it again. An entry that leaves while handed back
(the usual end of a stream) is freed at once: the thread took it out of the set itself. One
that leaves while in the set may still be named by an event the thread took: the loop frees it
when the thread says it holds no more reference to it (``K_FREE``, sent at the top of the
thread's next iteration). Notes to the loop go through a locked queue and
an eventfd the loop reads.

Scheduling. After a batch of reads that handed anything back, the thread yields its core
(``sched_yield``): the loop, woken by the eventfd, then runs before the thread relays its next
batch. Where both threads share one core, a stream's end (the hand-back its client's next
request waits behind) would otherwise wait for the thread's slice: measured on 200 paced
streams, the loop's wait for the core per stream halved and the next streams' first events came
sooner, at no cost per event (one syscall per batch that ends streams).
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.stdio cimport snprintf
from libc.string cimport memcpy, memset
from posix.uio cimport iovec
from posix.unistd cimport close, dup, read, write

from sidecar.engine._direct_socket cimport DirectSocket
from sidecar.engine.relay cimport BodyRelay, ClientOutput

import os
import resource

from sidecar.engine.parse_errors import ParseError
# (C longs: _mode reads them at each enrolment, where a module global is a dict lookup)
cdef long CHUNKED, DECHUNK, EOF_CHUNKED, LENGTH
from sidecar.engine.relay import CHUNKED, DECHUNK, EOF_CHUNKED, LENGTH


cdef extern from "<pthread.h>" nogil:
    int pthread_setname_np(pthread_t t, const char *name)

cdef extern from "<signal.h>" nogil:
    ctypedef struct sigset_t:
        pass
    int sigfillset(sigset_t *set)
    int pthread_sigmask(int how, const sigset_t *set, sigset_t *old)
    enum:
        SIG_BLOCK

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "<sys/eventfd.h>" nogil:
    int eventfd(unsigned int initval, int flags)
    enum:
        EFD_NONBLOCK
        EFD_CLOEXEC

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
    struct msghdr:
        iovec *msg_iov
        size_t msg_iovlen
    ssize_t sendmsg(int fd, const msghdr *msg, int flags)
    enum:
        MSG_DONTWAIT
        MSG_NOSIGNAL

cdef enum:
    # Bytes per read (the loop's own transports read up to 256 KiB).
    READ_SIZE = 262144
    # Events taken per wait (more stay ready: the set is level-triggered).
    BATCH = 64
    # Hex digits of a chunk size the thread passes (the relay's own limit: below 2**60).
    MAX_DIGITS = 15
    # How the thread relays a body.
    M_LENGTH = 0
    M_CHUNKED = 1  # passed through as it came
    M_DECHUNK = 2  # chunked, to an HTTP/1.0 client: the data only
    M_EOF_CHUNKED = 3  # delimited by the upstream's close, one chunk per read to an HTTP/1.1 client
    M_RAW = 4  # delimited by the upstream's close, passed through to an HTTP/1.0 client
    # A connection handed back for a read after fewer passes than this since it was enrolled
    # (a body whose reads the thread rarely passes through: extensions on every chunk, events
    # split across reads) goes back to its transport for BACKOFF reads: each hand-back costs
    # two wakeups and two epoll changes, more than its transport's read.
    MIN_PASSES = 4
    BACKOFF = 64
    # Pieces one send gathers (a dechunked read with more pieces is the relay's).
    MAX_IOV = 64
    # The bytes of an entry's last reads it keeps when asked (enroll's ``tail``): what the
    # usage reader reads of a body's end (sidecar.usage.LAST_BYTES).
    TAIL_BYTES = 16384
    # Enrolments that look for the event loop's epoll set before giving up (see unwatch).
    MAX_FINDS = 8
    # Notes to the loop.
    K_READ = 0  # a read the thread did not relay: ``data`` holds it
    K_FULL = 1  # the client's socket took only part of a read: ``data`` holds the rest
    K_STOP = 2  # the upstream socket has a close (``n`` 0) or an error (``n``: its errno)
    K_NOMEM = 3  # a read could not be kept (no memory): the response fails
    K_FREE = 4  # the thread holds no reference to the entry any more: free it
    K_END = 5  # the read that ends the body went to the client (``data``: what the socket did not take)


cdef const char *CRLF = b"\r\n"


cdef long S_SIZE, S_DATA  # the relay's chunked framing states the thread starts from and leaves


def _relay_states():
    """The relay's states at a chunk's size line and in its data, as the relay itself reaches
    them (its constants are C-level, not importable)."""
    relay = BodyRelay(ClientOutput(None), DECHUNK, 0, 0)
    size = relay.state
    relay.feed(b"5\r\n")  # (dechunked: nothing to write yet)
    return size, relay.state


S_SIZE, S_DATA = _relay_states()


cdef inline void _post(Shared *s, Note *note) noexcept nogil:
    """Queue ``note`` for the loop (``qlock`` held)."""
    note.next = NULL
    if s.tail == NULL:
        s.head = note
    else:
        s.tail.next = note
    s.tail = note


cdef inline void _ring(Shared *s) noexcept nogil:
    cdef uint64_t one = 1
    write(s.notify, &one, 8)


cdef long long _chunks(Entry *e, const unsigned char *b, Py_ssize_t n, iovec *iov, int *cnt) noexcept nogil:
    """Follow chunked framing through ``b[:n]`` from where ``e`` is (``e.left`` data bytes of
    a chunk still to come, or 0: at a chunk's size line) as the relay would, but only along the
    path it takes for plain data: sizes without extensions, none the last (``_last_chunk``
    recognises that one), each line and data followed by CRLF. Return the data bytes left in the
    chunk at the end of the read (0: at a size line), or -1 where the read leaves that path. For
    a dechunked body (``M_DECHUNK``), the data's pieces go to ``iov`` (``cnt`` of them)."""
    cdef Py_ssize_t pos = 0, take, digits
    cdef unsigned long long left = e.left[0]
    cdef unsigned char c
    while pos < n:
        if left:
            take = n - pos
            if <unsigned long long>take > left:
                take = left
            if e.mode == M_DECHUNK:
                if cnt[0] == MAX_IOV:
                    return -1
                iov[cnt[0]].iov_base = <void *>(b + pos)
                iov[cnt[0]].iov_len = take
                cnt[0] += 1
            pos += take
            left -= take
            if left:
                break  # (pos == n: the chunk goes on in the next read)
            if n - pos < 2 or b[pos] != 13 or b[pos + 1] != 10:
                return -1
            pos += 2
        else:
            digits = 0
            while pos < n:
                c = b[pos]
                if 48 <= c <= 57:
                    c -= 48
                elif 65 <= c <= 70:
                    c -= 55
                elif 97 <= c <= 102:
                    c -= 87
                else:
                    break
                if digits == MAX_DIGITS:
                    return -1
                left = left * 16 + c
                digits += 1
                pos += 1
            if left == 0 or n - pos < 2 or b[pos] != 13 or b[pos + 1] != 10:
                return -1
            pos += 2
    return <long long>left


cdef bint _last_chunk(Entry *e, const unsigned char *b, Py_ssize_t n) noexcept nogil:
    """Whether ``b[:n]`` is whole plain chunks (as ``_chunks`` follows them) then the last
    chunk with no extension and no trailer, ending the read: the body's usual end, which the
    thread sends itself."""
    cdef iovec iov[1]
    cdef int cnt = 0
    return (
        n >= 5
        and b[n - 5] == 48 and b[n - 4] == 13 and b[n - 3] == 10 and b[n - 2] == 13 and b[n - 1] == 10
        and _chunks(e, b, n - 5, iov, &cnt) == 0
    )


cdef inline void _keep(Entry *e, const unsigned char *b, Py_ssize_t n) noexcept nogil:
    """Keep ``b[:n]``, a read of ``e``'s upstream socket, in its ring of last bytes."""
    cdef Py_ssize_t room
    e.relayed += n
    if n >= TAIL_BYTES:
        memcpy(e.tail, b + n - TAIL_BYTES, TAIL_BYTES)
        e.tail_at = 0
        e.tail_full = True
        return
    room = TAIL_BYTES - e.tail_at
    if n < room:
        memcpy(e.tail + e.tail_at, b, n)
        e.tail_at += n
        return
    memcpy(e.tail + e.tail_at, b, room)
    memcpy(e.tail, b + room, n - room)
    e.tail_at = n - room
    e.tail_full = True


cdef void _hand(Shared *s, Entry *e, int kind, unsigned char *data, Py_ssize_t n) noexcept nogil:
    """Hand ``e`` back to the loop (``e.lock`` held), with ``data[:n]``: copied from the read
    buffer for ``K_READ``, taken as it is (allocated, or NULL) for ``K_FULL`` and ``K_END``; for
    ``K_STOP``, ``data`` is NULL and ``n`` the read's errno (0: a close)."""
    cdef char *copy = <char *>data
    e.held = True
    s.handed_back += 1
    epoll_ctl(s.epfd, EPOLL_CTL_DEL, e.ufd, NULL)
    if kind == K_READ:
        copy = <char *>malloc(n)
        if copy == NULL:
            kind = K_NOMEM
            n = 0
        else:
            memcpy(copy, data, n)
    e.back.entry = e
    e.back.kind = kind
    e.back.data = copy
    e.back.n = n
    e.queued = True
    pthread_mutex_lock(&s.qlock)
    _post(s, &e.back)
    pthread_mutex_unlock(&s.qlock)
    _ring(s)


cdef void _relay(Shared *s, Entry *e) noexcept nogil:
    """One read of ``e``'s upstream socket (``e.lock`` held), relayed or handed back."""
    cdef Py_ssize_t got, sent, total, skip
    cdef long long left
    cdef iovec iov[MAX_IOV]
    cdef int cnt = 1, i
    cdef bint end = False  # the read ends the body (and holds nothing after it)
    cdef msghdr msg
    cdef char size[20]
    cdef unsigned char *rest
    got = recv(e.ufd, s.buf, READ_SIZE, MSG_DONTWAIT)
    if got <= 0:
        if got == 0:
            _hand(s, e, K_STOP, NULL, 0)
        elif errno != EAGAIN and errno != EINTR:
            _hand(s, e, K_STOP, NULL, errno)
        return
    s.reads += 1
    if e.tail != NULL:  # (a copy of the read: the loop is not woken for it)
        _keep(e, s.buf, got)
    iov[0].iov_base = <void *>s.buf
    iov[0].iov_len = got
    total = got
    if e.mode == M_CHUNKED or e.mode == M_DECHUNK:
        if e.mode == M_DECHUNK:
            cnt = 0
        left = _chunks(e, s.buf, got, iov, &cnt)
        if left < 0:
            # The body's usual end (passed through) is sent here, the loop told after; any other
            # read off the plain path is the relay's.
            if e.mode != M_CHUNKED or not _last_chunk(e, s.buf, got):
                _hand(s, e, K_READ, s.buf, got)
                return
            end = True
            left = 0
        e.left[0] = left
        e.state[0] = S_DATA if left else S_SIZE
        if e.mode == M_DECHUNK:
            total = 0
            for i in range(cnt):
                total += iov[i].iov_len
    elif e.mode == M_LENGTH:
        if <unsigned long long>got > e.left[0]:  # bytes after the body's end: the relay's to handle
            _hand(s, e, K_READ, s.buf, got)
            return
        end = <unsigned long long>got == e.left[0]
        e.left[0] -= got
    elif e.mode == M_EOF_CHUNKED:  # one chunk per read
        iov[0].iov_base = size
        iov[0].iov_len = snprintf(size, sizeof(size), "%zx\r\n", got)
        iov[1].iov_base = <void *>s.buf
        iov[1].iov_len = got
        iov[2].iov_base = <void *>CRLF
        iov[2].iov_len = 2
        cnt = 3
        total = iov[0].iov_len + got + 2
    e.reads[0] += 1
    e.passes += 1
    if total == 0:
        return
    memset(&msg, 0, sizeof(msg))
    msg.msg_iov = iov
    msg.msg_iovlen = cnt
    sent = sendmsg(e.cfd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL)
    if sent == total:
        if end:
            _hand(s, e, K_END, NULL, 0)
        return
    if sent < 0:  # EAGAIN, or an error the client's transport will meet and report
        sent = 0
    # The rest goes out through the client's transport: gathered here (the read buffer is reused).
    rest = <unsigned char *>malloc(total - sent)
    if rest == NULL:
        _hand(s, e, K_NOMEM, NULL, 0)
        return
    total = 0
    for i in range(cnt):
        skip = sent if sent < <Py_ssize_t>iov[i].iov_len else <Py_ssize_t>iov[i].iov_len
        sent -= skip
        memcpy(rest + total, <char *>iov[i].iov_base + skip, iov[i].iov_len - skip)
        total += iov[i].iov_len - skip
    _hand(s, e, K_END if end else K_FULL, rest, total)


cdef void *_run(void *arg) noexcept nogil:
    """The thread: relay enrolled sockets until ``running`` goes false."""
    cdef Shared *s = <Shared *>arg
    cdef epoll_event events[BATCH]
    cdef Entry *e
    cdef Entry *r
    cdef int n, i
    cdef bint running, freed
    cdef uint64_t v
    cdef unsigned long long handed
    cdef sigset_t blocked
    sigfillset(&blocked)  # signals are the main thread's (its handlers wake the event loop)
    pthread_sigmask(SIG_BLOCK, &blocked, NULL)
    while True:
        # Entries that left before this iteration: no event taken from now on can name them.
        pthread_mutex_lock(&s.qlock)
        r = s.retired
        s.retired = NULL
        freed = r != NULL
        while r != NULL:
            e = r
            r = r.next_retired
            e.freed.entry = e
            e.freed.kind = K_FREE
            e.freed.data = NULL
            _post(s, &e.freed)
        running = s.running
        pthread_mutex_unlock(&s.qlock)
        if freed:
            _ring(s)
        if not running:
            return NULL
        n = epoll_wait(s.epfd, events, BATCH, -1)
        handed = s.handed_back
        for i in range(n):
            e = <Entry *>events[i].data.ptr
            if e == NULL:  # the loop woke the thread (to stop, or to take entries that left)
                read(s.wake, &v, 8)
                continue
            pthread_mutex_lock(&e.lock)
            if not e.gone and not e.held:
                _relay(s, e)
            pthread_mutex_unlock(&e.lock)
        if s.handed_back != handed:
            # The loop has work from this batch (a stream's end, most often: its client's next
            # request waits for it). On a shared core the scheduler would let this thread go on
            # relaying other streams' events first, up to its whole slice; yield it instead.
            sched_yield()
    return NULL


cdef class Enrolled:
    """One enrolled connection, as the loop knows it."""


cdef class DirectReads:
    """The relay thread and its epoll set (see the module docstring)."""

    def __cinit__(self):
        self.s = NULL
        self.started = False

    def __init__(self, loop):
        cdef epoll_event ev
        cdef Shared *s
        self.loop = loop
        self.live = set()
        self.enrolled = 0
        self.loop_epfd = -1  # the event loop's own epoll set, once found (see unwatch)
        self.finds = 0
        # The thread's two descriptors per stream stop at three quarters of the open file limit.
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.fd_cap = 1 << 30 if soft == resource.RLIM_INFINITY else max(64, soft * 3 // 4)
        self.s = s = <Shared *>calloc(1, sizeof(Shared))
        if s == NULL:
            raise MemoryError()
        s.epfd = s.wake = s.notify = -1
        pthread_mutex_init(&s.qlock, NULL)
        s.buf = <unsigned char *>malloc(READ_SIZE)
        if s.buf == NULL:
            raise MemoryError()
        s.epfd = epoll_create1(EPOLL_CLOEXEC)
        s.wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        s.notify = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        if s.epfd < 0 or s.wake < 0 or s.notify < 0:
            raise OSError(errno, "epoll_create1/eventfd failed")
        ev.events = EPOLLIN
        ev.data.ptr = NULL
        if epoll_ctl(s.epfd, EPOLL_CTL_ADD, s.wake, &ev) < 0:
            raise OSError(errno, "epoll_ctl failed")
        s.running = True
        if pthread_create(&self.thread, NULL, _run, <void *>s) != 0:
            raise OSError(errno, "pthread_create failed")
        pthread_setname_np(self.thread, b"sidecar-streams")  # (what top -H and ps -L show)
        self.started = True
        loop.add_reader(s.notify, self._drain)

    @property
    def reads(self):
        """Reads the thread made."""
        return self.s.reads if self.s != NULL else 0

    @property
    def handed_back(self):
        """Times the thread handed a connection back to the loop."""
        return self.s.handed_back if self.s != NULL else 0

    def __dealloc__(self):
        self._shutdown()

    def close(self):
        """Stop relaying (the engine is closing; its connections are aborted)."""
        if self.started:
            self.loop.remove_reader(self.s.notify)
        self._shutdown()

    cdef void _stop(self) noexcept:
        """Stop the thread and wait for it."""
        cdef Shared *s = self.s
        cdef uint64_t one = 1
        if not self.started:
            return
        self.started = False
        pthread_mutex_lock(&s.qlock)
        s.running = False
        pthread_mutex_unlock(&s.qlock)
        write(s.wake, &one, 8)
        with nogil:
            pthread_join(self.thread, NULL)

    cdef void _shutdown(self) noexcept:
        """Stop the thread, then free everything: notes not taken, entries (live ones leave)."""
        cdef Shared *s = self.s
        cdef Note *note
        cdef Note *nxt
        cdef Entry *e
        cdef Enrolled entry
        if s == NULL:
            return
        self._stop()
        note = s.head  # (first: a note may belong to an entry freed below)
        while note != NULL:
            nxt = note.next
            if note.kind == K_FREE or note.entry.dead:
                _free_entry(note.entry)
            else:
                free(note.data)
                note.entry.queued = False
            note = nxt
        s.head = s.tail = NULL
        if self.live:
            for entry in self.live:
                _free_entry(entry.c)
                entry.c = NULL
            self.live.clear()
        while s.retired != NULL:
            e = s.retired
            s.retired = e.next_retired
            _free_entry(e)
        if s.epfd >= 0:
            close(s.epfd)
        if s.wake >= 0:
            close(s.wake)
        if s.notify >= 0:
            close(s.notify)
        pthread_mutex_destroy(&s.qlock)
        free(s.buf)
        free(s)
        self.s = NULL

    cpdef Enrolled enroll(self, object conn, int fd, BodyRelay relay, bint tail=False):
        """Relay ``conn``'s socket ``fd`` into ``relay`` from here from now on: the entry to leave
        with, or None if it cannot be (the transport keeps reading it then): the client has no
        direct socket or has bytes waiting, the body's framing is not at a boundary the thread
        starts from, or a descriptor or memory could not be had. ``tail``: keep the last
        ``TAIL_BYTES`` of what the thread reads (a copy per read, on the thread), which
        :meth:`leave` returns."""
        cdef Enrolled entry
        cdef Entry *e
        cdef ClientOutput out = relay.output
        cdef DirectSocket sock = out.sock
        cdef int mode
        if self.s == NULL or not self.started or sock is None or sock.queued or out.closed or out.parts:
            return None
        mode = _mode(relay)
        if mode < 0:
            return None
        e = <Entry *>calloc(1, sizeof(Entry))
        if e == NULL:
            return None
        e.ufd = dup(fd)
        e.cfd = dup(sock.fd)
        if e.ufd < 0 or e.cfd < 0 or e.ufd >= self.fd_cap or e.cfd >= self.fd_cap:
            # (a descriptor this high means most of the open file limit is in use: the rest
            # is kept for accepting and connecting, and the transport reads this body)
            _free_entry_fds(e)
            free(e)
            return None
        if tail:
            e.tail = <unsigned char *>malloc(TAIL_BYTES)
            if e.tail == NULL:
                _free_entry_fds(e)
                free(e)
                return None
        pthread_mutex_init(&e.lock, NULL)
        e.mode = mode
        e.left = &relay.left
        e.state = &relay.state
        e.reads = &relay.reads
        entry = Enrolled.__new__(Enrolled)
        entry.c = e
        entry.conn = conn
        entry.relay = relay
        e.owner = <void *>entry
        if not self._arm(e):
            entry.c = NULL
            _free_entry(e)
            return None
        self.live.add(entry)
        self.enrolled += 1
        return entry

    cdef bint _arm(self, Entry *e) noexcept:
        """Put ``e`` in the thread's set (again)."""
        cdef epoll_event ev
        ev.events = EPOLLIN | EPOLLRDHUP
        ev.data.ptr = <void *>e
        pthread_mutex_lock(&e.lock)
        e.held = False
        pthread_mutex_unlock(&e.lock)
        return epoll_ctl(self.s.epfd, EPOLL_CTL_ADD, e.ufd, &ev) == 0

    cpdef leave(self, Enrolled entry, int fd):
        """Stop relaying the connection enrolled as ``entry``: when this returns, the thread no
        longer touches its sockets (``fd`` is unused: the thread reads a descriptor of its own).
        For an entry enrolled with ``tail``: ``(the last bytes it read, how many it read)``,
        else None."""
        cdef Entry *e = entry.c
        cdef Shared *s = self.s
        cdef bint held
        tail = None
        if e == NULL or s == NULL:
            return tail
        entry.c = NULL
        self.live.discard(entry)
        pthread_mutex_lock(&e.lock)
        e.gone = True
        held = e.held
        pthread_mutex_unlock(&e.lock)
        if e.tail != NULL:  # (gone: the thread no longer writes it)
            if e.tail_full:
                kept = PyBytes_FromStringAndSize(<char *>e.tail + e.tail_at, TAIL_BYTES - e.tail_at) + \
                    PyBytes_FromStringAndSize(<char *>e.tail, e.tail_at)
            else:
                kept = PyBytes_FromStringAndSize(<char *>e.tail, e.tail_at)
            tail = (kept, e.relayed)
        if held:
            # Handed back (the usual end of a stream): out of the set since, so no event the
            # thread takes names it; free it now, or once its note is taken if still queued.
            _free_entry_fds(e)
            if e.queued:
                e.dead = True
            else:
                _free_entry(e)
            return tail
        # Still in the set: out of it before its descriptor closes (closing a dup does not take
        # the socket out of the set while the loop's own descriptor keeps it open), and the
        # thread may hold an event for it until its next iteration.
        epoll_ctl(s.epfd, EPOLL_CTL_DEL, e.ufd, NULL)
        _free_entry_fds(e)
        pthread_mutex_lock(&s.qlock)
        e.next_retired = s.retired
        s.retired = e
        pthread_mutex_unlock(&s.qlock)
        return tail

    cpdef settle(self, Enrolled entry):
        """Act now on ``entry``'s hand-back if it is the body's end, sent whole to the client:
        the loop is about to give the response up because its client left, perhaps before the
        thread's note of that end reached it (a client that closes as soon as it has the last
        byte). A body delivered whole is complete, whatever its client did after. Waits for a
        read the thread is relaying for ``entry`` to be done, as :meth:`leave` does."""
        cdef Entry *e = entry.c
        cdef bint whole
        if e == NULL or self.s == NULL:
            return
        pthread_mutex_lock(&e.lock)
        whole = e.held and e.queued and e.back.kind == K_END and e.back.data == NULL
        pthread_mutex_unlock(&e.lock)
        if whole:
            # (the note stays queued: the connection leaves as the response ends, and the
            # entry, dead, is freed when the loop takes it)
            self._back(entry, K_END, None, 0)

    cpdef unwatch(self, int fd):
        """Take the socket ``fd`` out of the event loop's own epoll set: its transport was just
        paused for the thread. libuv leaves a paused socket in its set and removes it only at its
        next event, so without this the thread's first read of every stream would wake the loop
        too, for nothing. The caller makes sure the transport has nothing to write: libuv then
        holds the socket for unwatched and adds it again when reading (or writing) starts; with a
        write pending it would later modify a registration that must still exist. The set is
        found at the first enrolments, as the one epoll set of the process, other than the
        thread's, that holds ``fd``; where there is none (asyncio's own loop removes a paused
        socket at once; /proc unreadable), this does nothing."""
        if self.loop_epfd < 0:
            if self.finds >= MAX_FINDS:
                return
            self.finds += 1
            self.loop_epfd = _epoll_holding(fd, self.s.epfd if self.s != NULL else -1)
            if self.loop_epfd < 0:
                return
        epoll_ctl(self.loop_epfd, EPOLL_CTL_DEL, fd, NULL)  # (not there: ENOENT, nothing to do)

    def _drain(self):
        """The thread's notes: hand-backs to act on, entries to free."""
        cdef Shared *s = self.s
        cdef Note *note
        cdef Note *nxt
        cdef Entry *e
        cdef uint64_t v
        if s == NULL:
            return
        read(s.notify, &v, 8)
        pthread_mutex_lock(&s.qlock)
        note = s.head
        s.head = s.tail = NULL
        pthread_mutex_unlock(&s.qlock)
        while note != NULL:
            nxt = note.next  # (read first: acting on a note may post it again)
            e = note.entry
            if note.kind == K_FREE:
                _free_entry(e)
            else:
                e.queued = False
                data = None
                if note.data != NULL:
                    data = PyBytes_FromStringAndSize(note.data, note.n)
                    free(note.data)
                    note.data = NULL
                if e.dead:  # it left while this note waited
                    _free_entry(e)
                elif not e.gone:
                    self._back(<Enrolled>e.owner, note.kind, data, note.n if note.kind == K_STOP else 0)
            note = nxt

    cdef _back(self, Enrolled entry, int kind, object data, Py_ssize_t err):
        """Act on a hand-back of ``entry`` (out of the thread's set until enrolled again);
        ``err``: the errno of a ``K_STOP``'s read (0: a close)."""
        cdef BodyRelay relay = entry.relay
        conn = entry.conn
        if kind == K_READ:
            try:
                used = relay.feed(data)
            except ParseError as exc:
                conn.invalid_body(exc)
                return
            except Exception as exc:  # a defect: it costs this response, as with a transport's read
                self.loop.call_exception_handler(
                    {"message": "upstream data_received failed", "exception": exc, "protocol": conn}
                )
                conn._fail(f"response not relayed: {exc!r}")
                return
            if relay.done:
                conn.body_end(len(data) - used)
            elif entry.c != NULL and (entry.c.passes < MIN_PASSES or not self._again(entry, relay)):
                # The thread cannot follow this body here, or keeps handing it back: the
                # transport reads it, and enrolling is tried again after BACKOFF reads.
                conn.direct_stop()
                conn.enroll_at = relay.reads + BACKOFF
        elif kind == K_END:
            if data is not None:
                relay.output.parts.append(data)
                relay.output.flush()
            relay.end_sent()
            conn.body_end(0)
        elif kind == K_FULL:
            relay.output.parts.append(data)  # through the transport: the client's backpressure follows
            relay.output.flush()
            if entry.c != NULL:
                conn.direct_stop()
        elif kind == K_STOP:
            conn.direct_stop()
            if err:  # taken from the socket by the thread's read: the transport would not see it
                conn.read_failed(OSError(err, os.strerror(err)))
        else:
            conn._fail("response not relayed: out of memory")

    cdef bint _again(self, Enrolled entry, BodyRelay relay):
        """Enrol ``entry`` again after a hand-back, if the thread can go on from where the relay is."""
        cdef ClientOutput out = relay.output
        if out.sock is None or out.sock.queued or out.closed or out.parts:
            return False
        if _mode(relay) < 0:
            return False
        entry.c.passes = 0
        return self._arm(entry.c)


def _epoll_holding(int fd, int own):
    """The one epoll descriptor of this process, other than ``own``, whose set holds ``fd``
    (from /proc/self/fdinfo), or -1."""
    found = []
    want = str(fd)
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return -1
    for name in names:
        if not name.isdigit() or int(name) == own:
            continue
        try:
            if os.readlink(f"/proc/self/fd/{name}") != "anon_inode:[eventpoll]":
                continue
            with open(f"/proc/self/fdinfo/{name}") as info:
                for line in info:
                    words = line.split()
                    if len(words) > 1 and words[0] == "tfd:" and words[1] == want:
                        found.append(int(name))
                        break
        except OSError:
            continue
    return found[0] if len(found) == 1 else -1


cdef int _mode(BodyRelay relay):
    """How the thread can relay ``relay``'s body from where it is (-1: it cannot)."""
    mode = relay.mode
    if mode == CHUNKED or mode == DECHUNK:
        if relay.digits or not (relay.state == S_SIZE and relay.left == 0 or relay.state == S_DATA and relay.left):
            return -1
        return M_CHUNKED if mode == CHUNKED else M_DECHUNK
    if mode == LENGTH:
        return M_LENGTH if relay.left else -1
    return M_EOF_CHUNKED if mode == EOF_CHUNKED else M_RAW


cdef void _free_entry_fds(Entry *e) noexcept:
    if e.ufd >= 0:
        close(e.ufd)
    if e.cfd >= 0:
        close(e.cfd)
    e.ufd = e.cfd = -1


cdef void _free_entry(Entry *e) noexcept:
    _free_entry_fds(e)
    free(e.tail)
    pthread_mutex_destroy(&e.lock)
    free(e)
