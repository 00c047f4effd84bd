# Compiled (see setup.py) so that the mode's per-request hooks run as C code rather than
# bytecode; its classes stay Python classes (modes subclass Mode), their methods compile.
