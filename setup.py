"""Optional compiled build of the fast engine's hot modules.

The modules in ``COMPILED`` (those with a ``.pxd`` file) are plain Python that also compiles with
Cython: the ``.pxd`` file beside each one declares its classes as extension types with typed
fields, which makes the per-request attribute traffic C struct accesses. Four modules are
compiled only: ``sidecar/engine/llhttp_parser.pyx``, the request parser over the vendored llhttp
(``vendor/llhttp``), ``sidecar/_jsonscan.pyx``, the JSON scanner in C, and
``sidecar/engine/_direct_socket.pyx`` and ``_direct_reads.pyx``, the streamed bodies' direct
socket I/O. When Cython or a C compiler is missing (or ``SIDECAR_PURE_PYTHON=1``), the same
modules install and run as pure Python, requests are parsed with httptools
(:mod:`sidecar.engine.parsers`) and JSON is scanned by :mod:`sidecar.jsonscan` (and streamed
bodies go through the transports).

``SIDECAR_REQUIRE_COMPILED=1`` (the container image sets it) turns that fallback into an error:
a missing Cython or a failed compile fails the build instead of quietly installing the pure-Python
modules, which cost several times the CPU per request.
"""

import os
from pathlib import Path

from setuptools import Extension, setup

# A module is compiled exactly when it has a .pxd beside it (the declarations it needs).
# (A .pxd without a .py beside it declares a compiled-only .pyx module, listed below, or holds
# inline C helpers only: sidecar/engine/_memscan.pxd, sidecar/_usagescan.pxd.)
COMPILED = sorted(str(p.with_suffix(".py")) for p in Path("sidecar").rglob("*.pxd") if p.with_suffix(".py").exists())
LLHTTP_SOURCES = [f"vendor/llhttp/src/{name}.c" for name in ("api", "http", "llhttp")]


def extensions() -> list:
    require = os.environ.get("SIDECAR_REQUIRE_COMPILED") == "1"
    if os.environ.get("SIDECAR_PURE_PYTHON") == "1":
        if require:
            raise SystemExit("SIDECAR_REQUIRE_COMPILED=1 and SIDECAR_PURE_PYTHON=1 contradict each other")
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        if require:
            raise SystemExit(
                "SIDECAR_REQUIRE_COMPILED=1 but Cython is not installed: the compiled build "
                "needs it (pyproject's build-system requires cython)"
            ) from None
        return []
    # The request parser is compiled only: it drives the vendored llhttp with C callbacks.
    llhttp = Extension(
        "sidecar.engine.llhttp_parser",
        ["sidecar/engine/llhttp_parser.pyx", *LLHTTP_SOURCES],
        include_dirs=["vendor/llhttp/include"],
    )
    jsonscan = Extension("sidecar._jsonscan", ["sidecar/_jsonscan.pyx"])
    direct = [
        Extension(f"sidecar.engine.{m}", [f"sidecar/engine/{m}.pyx"]) for m in ("_direct_socket", "_direct_reads")
    ]
    exts = cythonize(
        [*COMPILED, llhttp, jsonscan, *direct],
        language_level=3,
        quiet=True,
        compiler_directives={"annotation_typing": False, "binding": False},
    )
    for ext in exts:
        # No C compiler: install the pure-Python modules instead, unless the compiled build is required.
        ext.optional = not require
    return exts


setup(ext_modules=extensions())
