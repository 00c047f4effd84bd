# Compiled layout of jsonbody.py (Cython "augmenting" declarations; see setup.py): the scanned
# body as an extension type (keep its fields equal to ScannedBody.__slots__) and the splice with
# typed locals (it runs once per body-mode request).
cimport cython
cdef class ScannedBody:
    cdef public bytes data
    cdef public Py_ssize_t status, start, end, last
    cdef public tuple names
    cdef public list hits

@cython.locals(start=Py_ssize_t, end=Py_ssize_t, last=Py_ssize_t, depth=Py_ssize_t, i=Py_ssize_t, index=Py_ssize_t,
               data=bytes, insert=bytes, member=bytes, hits=list, found=list, edits=list, paths=tuple)
cpdef bytes splice(ScannedBody body, tuple path, dict values, tuple owned=*)
cdef dict _PATHS
