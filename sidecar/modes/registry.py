"""Mode registry: every mode, built-in or third-party, comes from the ``sidecar.modes`` entry-point group."""

from __future__ import annotations

from functools import cache
from importlib.metadata import entry_points

from sidecar.modes.base import Mode, check_contract

GROUP = "sidecar.modes"


class UnknownMode(LookupError):
    """No mode is registered under that name."""


@cache
def _entry_points() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def available() -> list[str]:
    """Names of every registered mode, sorted."""
    return sorted(_entry_points())


@cache
def load_mode(name: str) -> type[Mode]:
    """The mode class registered as ``name``, checked against the plugin contract."""
    ep = _entry_points().get(name)
    if ep is None:
        raise UnknownMode(f"unknown mode {name!r} (available: {', '.join(available()) or 'none'})")
    cls = ep.load()  # type: ignore[attr-defined]
    check_contract(cls)
    if cls.name != name:
        raise UnknownMode(f"entry point {name!r} loads mode named {cls.name!r}")
    return cls


def refresh() -> None:
    """Forget cached entry points (tests that install a plugin at runtime)."""
    _entry_points.cache_clear()
    load_mode.cache_clear()
