# Compiled layout of fast.py (Cython "augmenting" declarations; see setup.py). The engine class
# is a Python class (it derives from the Engine ABC): nothing to declare, but the module is
# compiled with the rest of the request path (its per-request work lives in fast_connection,
# fast_exchange, fast_upstream and relay).
