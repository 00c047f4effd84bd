# Compiled layout of deployments.py (Cython "augmenting" declarations; see setup.py): the
# deployment the request path reads, as an extension type. Keep the fields in the dataclass's order.
from sidecar.metrics cimport DeploymentStats

cdef class Deployment:
    cdef public str name
    cdef public object mode
    cdef public str mode_name
    cdef public tuple upstreams
    cdef public bint trust_client_headers
    cdef public bint strict
    cdef public bint reject_non_object_body
    cdef public object timeouts
    cdef public object limits
    cdef public frozenset models
    cdef public object health_check
    cdef public object balancer
    cdef public DeploymentStats stats
    cdef public frozenset drop
    cdef public frozenset drop_sessionless
    cdef public bint observes_responses
    cdef public bint rewrites_body
    cdef public object only_upstream
    cdef public object max_body_bytes
    cdef public object max_parsed_body_bytes
    cdef public long max_json_depth
    cdef public double connect_timeout
    cdef public double first_byte_timeout
    cdef public double idle_timeout
