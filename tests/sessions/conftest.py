"""Fixtures of the sessions tests (see tests/sessions/support.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.sessions.support import Launch, launcher


@pytest.fixture
async def launch(engine: str) -> AsyncIterator[Launch]:
    """Sidecars of the parametrized engine, from config-file keys."""
    async for f in launcher(engine):
        yield f


@pytest.fixture
async def launch_api() -> AsyncIterator[Launch]:
    """Sidecars for tests of the admin listener only (the engine does not matter there)."""
    async for f in launcher("aiohttp"):
        yield f


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s
