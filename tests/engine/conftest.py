"""Fixtures of the engine tests: the scripted raw upstream (see :mod:`tests.engine`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from tests.engine import Handler, RawUpstream

StartUpstream = Callable[..., Awaitable[RawUpstream]]


@pytest.fixture
async def raw_upstream() -> AsyncIterator[StartUpstream]:
    started: list[RawUpstream] = []

    async def start(routes: dict[str, Handler] | None = None, **kw: Any) -> RawUpstream:
        up = await RawUpstream(routes, **kw).start()
        started.append(up)
        return up

    yield start
    for up in started:
        await up.stop()
