# Compiled layout of request_rules.py (Cython "augmenting" declarations; see setup.py): the fast
# engine asks plain() of every head and lone_chunked() of every chunked response, as C calls.
cimport cython
from sidecar.engine.head cimport dot_segment, origin_form, valid_host

cdef long _HOST_FACTS, HOST_SEEN, HOST_REPEATED, HOST_INVALID, LISTED
cpdef bint plain(bint keep_alive, long head_bits, bytes method, bytes target) except -1
cpdef bint lone_chunked(list values) except -1
