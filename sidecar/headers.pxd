# Compiled layout of headers.py (Cython "augmenting" declarations; see setup.py): the field-value
# check runs on every request that carries an id or gets headers from its mode, from compiled callers.
cpdef bint is_field_value(str value) except -1
