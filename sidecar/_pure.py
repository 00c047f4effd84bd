"""Load the sidecar's modules from their ``.py`` sources even where compiled ones are installed.

Python's path finder prefers an extension module (``fast.cpython-311-*.so``) to ``fast.py`` in
the same directory; the finder here runs first and picks the source. See ``SIDECAR_PURE_PYTHON``
in ``sidecar/__init__.py`` and ``setup.py``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

# Modules that exist only compiled: with sources preferred, they are absent (their importers
# fall back to pure-Python equivalents).
COMPILED_ONLY = frozenset(
    {
        "sidecar.engine.llhttp_parser",
        "sidecar._jsonscan",
        "sidecar.engine._direct_socket",
        "sidecar.engine._direct_reads",
    }
)


class _SourceFinder(MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname in COMPILED_ONLY:
            raise ModuleNotFoundError(f"{fullname} is compiled only (SIDECAR_PURE_PYTHON=1)", name=fullname)
        if path is None or not fullname.startswith("sidecar."):
            return None
        name = fullname.rpartition(".")[2]
        for entry in path:
            source = os.path.join(entry, name + ".py")
            if os.path.isfile(source):
                return importlib.util.spec_from_file_location(fullname, source)
        return None  # a package, or not found: the regular finders decide


def prefer_sources() -> None:
    """Install the finder (idempotent)."""
    if not any(isinstance(f, _SourceFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceFinder())
