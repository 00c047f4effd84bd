# Compiled layout of jsonbody.py (Cython "augmenting" declarations; see setup.py): the scanned
# body as an extension type. Keep its fields equal to ScannedBody.__slots__.
cdef class ScannedBody:
    cdef public bytes data
    cdef public Py_ssize_t status, start, end, last
    cdef public tuple names
    cdef public list hits
