"""Which build a module runs as: compiled by Cython (setup.py) or from its Python source."""

from __future__ import annotations

from importlib.machinery import EXTENSION_SUFFIXES
from types import ModuleType


def is_compiled(module: ModuleType) -> bool:
    """Whether ``module`` runs as a compiled extension (see setup.py) rather than from source."""
    return (module.__file__ or "").endswith(tuple(EXTENSION_SUFFIXES))
