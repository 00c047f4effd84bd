# Compiled (see setup.py) so that the modes' per-request hooks run as C code rather than
# bytecode; its classes stay Python classes (modes subclass Mode), their methods compile.
