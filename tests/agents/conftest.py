"""Fixtures of the `agents` suite: the scripted endpoint, and the shared-store fixtures for the
two-replica runs. A client that cannot run here (no Node, not installed) is skipped with the
reason, except in CI (``CI`` set), where it fails: CI has Node and runs scripts/test.sh."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from tests.agents.harness import Client, missing
from tests.agents.scripted_llm import ScriptedLLM
from tests.state.conftest import redis_server, replicas  # noqa: F401  (fixtures of the two-replica runs)


@pytest.fixture
async def llm() -> AsyncIterator[ScriptedLLM]:
    server = await ScriptedLLM().start()
    yield server
    await server.stop()


def require(client: Client) -> None:
    """Skip (fail in CI) when ``client`` cannot run on this machine."""
    why = missing(client)
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)
