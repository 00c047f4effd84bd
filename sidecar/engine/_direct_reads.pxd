# Declarations of _direct_reads.pyx (compiled build only), for the modules that call it at C level.
from sidecar.engine.relay cimport BodyRelay

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *m, const void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *m)
    int pthread_mutex_lock(pthread_mutex_t *m)
    int pthread_mutex_unlock(pthread_mutex_t *m)
    int pthread_create(pthread_t *t, const void *attr, void *(*start)(void *) noexcept nogil, void *arg)
    int pthread_join(pthread_t t, void **ret)

cdef struct Note:
    Note *next
    Entry *entry
    int kind
    char *data
    Py_ssize_t n


cdef struct Entry:
    pthread_mutex_t lock
    int ufd, cfd  # the thread's own descriptors of the upstream and client sockets
    int mode
    bint gone  # left (set by the loop under ``lock``): the thread skips it
    bint held  # handed back (set by the thread): out of the epoll set until enrolled again
    bint queued  # its hand-back note waits in the queue (set by the thread, cleared by the loop)
    bint dead  # left while its note waited: freed when the loop takes the note
    unsigned long long *left  # the relay's ``left`` (body or chunk data bytes still to come)
    long *state  # the relay's framing state (chunked)
    unsigned long *reads  # the relay's ``reads`` (the exchange's idle timeout watches it)
    unsigned long passes  # reads passed through since enrolled (again)
    unsigned char *tail  # the last TAIL_BYTES bytes it read, a ring (NULL: not kept)
    Py_ssize_t tail_at  # where the ring's next byte goes
    bint tail_full  # the ring went round: its oldest byte is at ``tail_at``
    unsigned long long relayed  # the bytes it read since enrolled (kept in ``tail`` when it is kept)
    void *owner  # its Enrolled (borrowed: valid while not gone)
    Note back  # the one hand-back note it can have (no reads while held)
    Note freed
    Entry *next_retired


cdef struct Shared:
    int epfd, wake, notify
    bint running
    pthread_mutex_t qlock  # guards the queue, ``retired`` and ``running``
    Note *head
    Note *tail
    Entry *retired
    unsigned char *buf
    unsigned long long reads, handed_back



cdef class Enrolled:
    cdef Entry *c
    cdef object conn
    cdef BodyRelay relay

cdef class DirectReads:
    cdef Shared *s
    cdef pthread_t thread
    cdef bint started
    cdef int fd_cap
    cdef int loop_epfd, finds
    cdef object loop
    cdef set live
    cdef public unsigned long long enrolled
    cpdef Enrolled enroll(self, object conn, int fd, BodyRelay relay, bint tail=*)
    cpdef leave(self, Enrolled entry, int fd)
    cpdef settle(self, Enrolled entry)
    cpdef unwatch(self, int fd)
    cdef void _stop(self) noexcept
    cdef void _shutdown(self) noexcept
    cdef bint _arm(self, Entry *e) noexcept
    cdef _back(self, Enrolled entry, int kind, object data, Py_ssize_t err)
    cdef bint _again(self, Enrolled entry, BodyRelay relay)
