# Compiled (see setup.py) so that the mode's per-request hooks run as C code rather than
# bytecode; its classes stay Python classes (modes subclass Mode), their methods compile.

# Read per request: C globals, not module-dict lookups (not cached from Python 3.12 on).
cdef str X_SESSION_ID
