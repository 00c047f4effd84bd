"""HTTP engines: they move bytes and ask the router what to change, nothing else."""

from __future__ import annotations

from importlib.machinery import EXTENSION_SUFFIXES
from types import ModuleType

from sidecar.engine.base import Engine


def engine_class(name: str) -> type[Engine]:
    """The engine class for a config ``engine`` value."""
    if name == "aiohttp":
        from sidecar.engine.aiohttp_engine import AiohttpEngine

        return AiohttpEngine
    if name == "fast":
        from sidecar.engine.fast import FastEngine

        return FastEngine
    raise ValueError(f"unknown engine {name!r}")


def is_compiled(module: ModuleType) -> bool:
    """Whether ``module`` runs as a compiled extension (see setup.py) rather than from source."""
    return (module.__file__ or "").endswith(tuple(EXTENSION_SUFFIXES))
