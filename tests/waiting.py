"""Waiting on a condition, not on the clock: a test polls what it asserts until it holds. The
deadline only bounds a test that fails; it never decides one that passes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def wait_for(condition: Callable[[], Any], timeout: float = 5.0, interval: float = 0.01) -> None:
    """Return once ``condition()`` is truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"condition not reached within {timeout} s"
        await asyncio.sleep(interval)


async def eventually(
    fetch: Callable[[], Awaitable[T]], check: Callable[[T], bool], timeout: float = 5.0, interval: float = 0.01
) -> T:
    """Await ``fetch()`` until ``check`` holds for what it returned, and return that; fail the test
    (showing the last value) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = await fetch()
        if check(got):
            return got
        assert time.monotonic() < deadline, got
        await asyncio.sleep(interval)


class LoopLag:
    """How late the event loop ran a 10 ms ticker while the block ran (``async with LoopLag() as
    lag``, then ``lag.worst`` in seconds). A test that checks that something happened within a
    time budget adds this to the budget: a busy machine delays every timer of the loop alike,
    the code under test included, and that delay is not the code's."""

    def __init__(self, period: float = 0.01) -> None:
        self.period = period
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.period
            await asyncio.sleep(self.period)
            self.worst = max(self.worst, loop.time() - due)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
