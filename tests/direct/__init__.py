"""Shared helpers of the stream-thread tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(check: Callable[[], bool], timeout: float = 5) -> None:
    """Wait (bounded) until ``check()`` holds: for what the stream thread does after the bytes a
    test reads (it hands a stream back to the loop just after writing the stream's last bytes)."""
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.002)
