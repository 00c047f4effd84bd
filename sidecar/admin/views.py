"""Bounds of the lineage views (``/v1/trees/{root}``, ``/ui/data.json``) and the driver that
builds them on the event loop without holding it.

The view builders of :class:`sidecar.lineage.SessionTree` are generators that pause every few
hundred nodes; :func:`run_sliced` runs one in slices of about ``SLICE_SECONDS`` and lets the event
loop serve requests between slices, so no view holds the proxy for more than a few milliseconds
however large the tree. A view built so may be a slightly inconsistent snapshot (requests go on
between slices); see the builders' docstrings. The admin application builds one view at a time
(:func:`views_lock`): concurrent views wait for their turn instead of each taking slices.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator
from typing import TypeVar

from aiohttp import web

__all__ = ["MAX_DEPTH", "MAX_NODES", "SLICE_SECONDS", "VIEWS_LOCK", "run_sliced", "views_lock"]

# Levels below a tree's root that a view nests. JSON encoders cap nesting (orjson at 255 levels; a
# tree level is two: the node object and its children array), and so do browsers' renderers.
MAX_DEPTH = 48
# Node dicts a view builds in all: bounds the one orjson call that serializes them (it runs on the loop).
MAX_NODES = 2000
SLICE_SECONDS = 0.002

T = TypeVar("T")

VIEWS_LOCK = web.AppKey("views_lock", asyncio.Lock)  # held while a view is being built


def views_lock(app: web.Application) -> asyncio.Lock:
    """The lock the view handlers of ``app`` build under (created by the first caller, before
    the application starts)."""
    return app.setdefault(VIEWS_LOCK, asyncio.Lock())


async def run_sliced(steps: Generator[None, None, T], *, slice_seconds: float | None = None) -> tuple[T, float]:
    """Run the builder ``steps`` to its end, letting the event loop run whenever a slice took
    ``slice_seconds`` (``SLICE_SECONDS`` as it is at the call). Returns the builder's result and
    the seconds spent in the slices (what the view cost the loop)."""
    if slice_seconds is None:
        slice_seconds = SLICE_SECONDS
    busy = 0.0
    start = time.perf_counter()
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, busy + time.perf_counter() - start
        now = time.perf_counter()
        if now - start >= slice_seconds:
            busy += now - start
            await asyncio.sleep(0)
            start = time.perf_counter()
