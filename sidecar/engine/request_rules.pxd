# Compiled layout of request_rules.py (docs/architecture.md, "Compiled and pure-Python builds"):
# the fast engine asks plain() of every head and lone_chunked() of every chunked response.
cimport cython
from sidecar.engine.head cimport dot_segment, origin_form, valid_host

cdef long _HOST_BITS, HOST_SEEN, HOST_REPEATED, HOST_INVALID, LISTED
cpdef bint plain(bint keep_alive, long head_bits, bytes method, bytes target) except -1
cpdef bint lone_chunked(list values) except -1
