"""A real redis-server on loopback for the shared-store tests, and sidecars that share it.

``redis_server`` starts Debian's ``redis-server`` (installed by scripts/test.sh) on a free port
with AOF on, in a temporary directory, and stops it by PID. Without one the tests are skipped,
except in CI (``CI`` set), where they fail: the shared store must be proven there.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from sidecar.app import Sidecar
from tests.conftest import _with_file


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process; ``kill()`` simulates a crash, ``start()`` restarts on the same data,
    ``restart_empty()`` on none (a store without persistence)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        assert exe is not None
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--dir",
                str(self.dir),
                "--protected-mode",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)
        self.proc = None

    def restart_empty(self) -> None:
        """Crash, lose every key (its append-only files are deleted) and start again, same port."""
        self.kill()
        shutil.rmtree(self.dir)
        self.dir.mkdir()
        self.start()

    def cli(self, *args: str) -> str:
        exe = shutil.which("redis-cli")
        assert exe is not None
        return subprocess.run(
            [exe, "-p", str(self.port), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed: scripts/test.sh installs it (Debian package redis-server)")
        pytest.skip("redis-server is not installed (scripts/test.sh installs it)")
    server = RedisServer(tmp_path / "redis")
    server.dir.mkdir()
    server.start()
    yield server
    server.kill(signal.SIGTERM)


@pytest.fixture
async def replicas(engine: str, redis_server: RedisServer) -> AsyncIterator[Any]:
    """``await replicas(n, upstream=url, **config_keys)``: n sidecars of the engine under test
    sharing the Redis server (one key prefix per test)."""
    started: list[Sidecar] = []
    prefix = f"t{os.getpid()}-{time.monotonic_ns()}:"

    async def start(n: int = 2, *, upstream: str, mode: str | None = None, **keys: Any) -> list[Sidecar]:
        out = []
        for _ in range(n):
            out.append(await start_one(upstream=upstream, mode=mode, **keys))
        return out

    async def start_one(*, upstream: str, mode: str | None = None, **keys: Any) -> Sidecar:
        state = {"url": redis_server.url, "key_prefix": prefix, **keys.pop("state", {})}
        flags = {"listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "upstream": upstream, "mode": mode, "engine": engine}
        cfg = _with_file(flags, {"state": state, "readiness_check_upstream": False, **keys})
        sc = Sidecar(cfg, registry=CollectorRegistry())
        await sc.start()
        started.append(sc)
        return sc

    start.one = start_one  # type: ignore[attr-defined]
    start.prefix = prefix  # type: ignore[attr-defined]
    yield start
    for sc in started:
        await sc.stop()
    await asyncio.sleep(0)


@pytest.fixture
async def start_upstreams() -> Any:
    """``await start_upstreams(n)``: n recording upstreams on loopback."""
    from tests.upstream import RecordingUpstream, start_upstream

    runners = []

    async def start(n: int) -> list[RecordingUpstream]:
        ups = []
        for _ in range(n):
            up = RecordingUpstream()
            runners.append(await start_upstream(up))
            ups.append(up)
        return ups

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
