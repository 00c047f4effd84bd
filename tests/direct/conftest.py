"""The direct socket I/O tests run on the default asyncio loop and on uvloop (what ``sidecar run``
uses): the engine pauses a transport's reading and reads its socket from an epoll set of its
own, which relies on how each loop stops and restarts watching a socket."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvloop


@pytest.hookimpl(optionalhook=True)
def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
