"""Waiting on a condition, not on the clock: a test polls what it asserts until it holds. The
deadline only bounds a test that fails; it never decides one that passes."""

from __future__ import annotations

import asyncio
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
