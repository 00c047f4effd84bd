"""HTTP engines: they move bytes and ask the router what to change, nothing else."""

from __future__ import annotations

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
