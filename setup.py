"""Optional compiled build of the fast engine's hot modules.

The modules in ``COMPILED`` (those with a ``.pxd`` file) are plain Python that also compiles with
Cython: the ``.pxd`` file beside each one declares its classes as extension types with typed
fields, which makes the per-request attribute traffic C struct accesses. When Cython or a C compiler is missing (or
``SIDECAR_PURE_PYTHON=1``), the same modules install and run as pure Python.
"""

import os
from pathlib import Path

from setuptools import setup

# A module is compiled exactly when it has a .pxd beside it (the declarations it needs).
COMPILED = sorted(str(p.with_suffix(".py")) for p in Path("sidecar").rglob("*.pxd"))


def extensions() -> list:
    if os.environ.get("SIDECAR_PURE_PYTHON") == "1":
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        return []
    exts = cythonize(COMPILED, language_level=3, quiet=True,
                     compiler_directives={"annotation_typing": False, "binding": False})
    for ext in exts:
        ext.optional = True  # no C compiler: install the pure-Python modules instead
    return exts


setup(ext_modules=extensions())
