"""Shared fixtures: a recording upstream and sidecars on real loopback sockets, for each engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar.app import Sidecar
from sidecar.config import build_config
from tests.engine import Handler, RawUpstream
from tests.upstream import RecordingUpstream, start_upstream

# Every proxy test runs against both engines (as uvicorn tests its two protocol implementations).
ENGINES = ["aiohttp", "fast"]


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    """Every proxy test runs once per engine."""
    return str(request.param)


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    up = RecordingUpstream()
    runner = await start_upstream(up)
    yield up
    await runner.cleanup()


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


StartSidecar = Callable[..., Awaitable[Sidecar]]


@pytest.fixture
async def start_sidecar(engine: str) -> AsyncIterator[StartSidecar]:
    """``await start_sidecar(upstream=url, mode=..., mode_opt=[...], **config_keys)``.

    Extra keyword arguments are config file keys (e.g. ``limits={"max_body_bytes": 10}``).
    """
    started: list[Sidecar] = []

    async def start(
        *, upstream: str | None = None, mode: str | None = None, mode_opt: list[str] | None = None, **file_keys: Any
    ) -> Sidecar:
        flags = {
            "listen": "127.0.0.1:0",
            "admin": "127.0.0.1:0",
            "upstream": upstream,
            "mode": mode,
            "mode_opt": mode_opt,
            "engine": engine,
        }
        cfg = build_config(flags=flags, env={}, file=None) if not file_keys else _with_file(flags, file_keys)
        sc = Sidecar(cfg, registry=CollectorRegistry())
        await sc.start()
        started.append(sc)
        return sc

    yield start
    for sc in started:
        await sc.stop()


def _with_file(flags: dict[str, Any], file_keys: dict[str, Any]) -> Any:
    """The config as a user would write it: ``file_keys`` in a YAML file, ``flags`` on top."""
    import os
    import tempfile

    import yaml

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(file_keys, f)
    try:
        return build_config(flags=flags, env={}, file=f.name)
    finally:
        os.unlink(f.name)
