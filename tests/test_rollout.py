"""Rollouts without refused connections: on SIGTERM the sidecar leaves the endpoints first
(``/readyz`` 503 at once), keeps accepting and serving for ``shutdown_delay_seconds``, then
drains and exits by itself.

The end-to-end test replaces one sidecar process by another behind a loopback "Service"
(tests/loopback_service.py: a TCP balancer that learns readiness late, as endpoint updates do)
while load runs through it, on new and on keep-alive connections.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest

from tests.engine import hang, read_response
from tests.loopback_service import LoopbackService
from tests.proxy.test_errors import free_ports
from tests.test_cli import spawn, stop
from tests.waiting import wait_for


async def readyz(admin_url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{admin_url}/readyz") as resp:
            return resp.status, await resp.json()


async def get_on_new_connection(port: int) -> tuple[int, str | None, bool]:
    """GET / on a fresh connection: (status, its Connection header, whether the sidecar closed after)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /during-delay HTTP/1.1\r\nHost: x\r\nX-Correlation-ID: late-1\r\n\r\n")
        async with asyncio.timeout(5):
            resp = await read_response(reader)
            closed = await reader.read(1) == b""
        return resp.status, resp.header("Connection"), closed
    finally:
        writer.close()


async def test_within_the_delay_new_connections_are_served_while_readyz_is_503(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    port = sc.engine.port
    # A keep-alive connection opened before the shutdown.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /before HTTP/1.1\r\nHost: x\r\n\r\n")
    first = await read_response(reader)
    assert first.status == 200 and first.header("Connection") != "close"
    hurry = asyncio.Event()
    shutdown = asyncio.create_task(sc.shutdown(60.0, hurry))
    await asyncio.sleep(0)
    try:
        status, body = await readyz(sc.admin_url)
        assert (status, body["status"]) == (503, "draining"), body
        assert "shutting down" in body["reason"]
        # A new connection is accepted and answered; the answer closes it, so the client's next
        # connection goes wherever its load balancer now points.
        assert await get_on_new_connection(port) == (200, "close", True)
        # The keep-alive connection is served too, and closed after its answer.
        writer.write(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
        second = await read_response(reader)
        assert (second.status, second.header("Connection")) == (200, "close")
        assert await reader.read(1) == b""
        assert [r.path for r in upstream.received] == ["/before", "/during-delay", "/after"]
        assert upstream.received[1].all("X-Dynamo-Session-ID") == ["late-1"]
        assert not shutdown.done()
    finally:
        writer.close()
        hurry.set()  # a second signal ends the delay
    await asyncio.wait_for(shutdown, 10)
    with pytest.raises(OSError):  # the drain stopped accepting
        await asyncio.open_connection("127.0.0.1", port)


async def test_the_drain_grace_bounds_the_shutdown_behind_an_upstream_that_never_answers(raw_upstream, start_sidecar):
    # A Kubernetes pod gets shutdown_delay + drain_grace + a margin before SIGKILL: past the
    # grace, requests still in flight are cut and the process goes on to end its sessions.
    up = await raw_upstream({"/silent": hang})
    sc = await start_sidecar(
        upstream=up.url, readiness_check_upstream=False, drain_grace_seconds=0.5, timeouts={"first_byte": 600}
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.engine.port)
    try:
        writer.write(b"GET /silent HTTP/1.1\r\nHost: x\r\nX-Correlation-ID: stuck-1\r\n\r\n")
        await wait_for(lambda: len(up.received) == 1)
        # Within the grace plus a few seconds; aiohttp's default would hold it for two minutes.
        await asyncio.wait_for(sc.shutdown(0.0, None), 10)
        async with asyncio.timeout(5):
            try:
                cut = await reader.read() == b""
            except ConnectionResetError:
                cut = True
        assert cut  # the client saw its connection end, no answer
    finally:
        writer.close()


def log_lines(proc: subprocess.Popen) -> list[dict]:
    """The process's JSON log lines once it exited."""
    return [
        orjson.loads(line) for line in (proc.stderr.read() if proc.stderr else "").splitlines() if line.startswith("{")
    ]


async def wait_ready(admin_url: str, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            if (await readyz(admin_url))[0] == 200:
                return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("the sidecar did not become ready")


def start_replica(name: str, upstream_url: str, engine: str, delay: float) -> tuple[subprocess.Popen, int, str]:
    port, admin_port = free_ports(2)
    proc = spawn(
        "--listen",
        f"127.0.0.1:{port}",
        "--admin",
        f"127.0.0.1:{admin_port}",
        "--upstream",
        upstream_url,
        "--mode",
        "dynamo_headers",
        "--engine",
        engine,
        env={"SIDECAR_SHUTDOWN_DELAY_SECONDS": str(delay), "SIDECAR_DRAIN_GRACE_SECONDS": "10"},
    )
    return proc, port, f"http://127.0.0.1:{admin_port}"


@dataclass
class Load:
    """Requests through the Service until stopped: some clients open a new connection per
    request, others keep theirs alive. Every answer other than 200 is a failure."""

    url: str
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    running: bool = True

    async def client(self, i: int, keepalive: bool) -> None:
        connector = aiohttp.TCPConnector(limit=1, force_close=not keepalive)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as s:
            n = 0
            while self.running:
                n += 1
                try:
                    async with s.get(f"{self.url}/load", headers={"X-Correlation-ID": f"c{i}-{n % 3}"}) as resp:
                        await resp.read()
                        if resp.status == 200:
                            self.ok += 1
                        else:
                            self.failures.append(f"client {i}: status {resp.status}")
                except (TimeoutError, aiohttp.ClientError) as exc:
                    self.failures.append(f"client {i} ({'keep-alive' if keepalive else 'new connections'}): {exc!r}")
                await asyncio.sleep(0.005)


async def test_replacing_a_sidecar_under_load_fails_no_request(upstream, engine):
    service = await LoopbackService(period=0.15, lag=0.5).start()
    old, old_port, old_admin = start_replica("A", upstream.url, engine, delay=2.0)
    new: subprocess.Popen | None = None
    load = Load(f"http://127.0.0.1:{service.port}")
    clients: list[asyncio.Task[None]] = []
    try:
        await wait_ready(old_admin, old)
        a = service.add("A", old_port, old_admin)
        await wait_for(lambda: a.ready, timeout=20)
        clients = [asyncio.create_task(load.client(i, keepalive=i % 2 == 0)) for i in range(6)]
        await wait_for(lambda: load.ok >= 50, timeout=20)

        new, new_port, new_admin = start_replica("B", upstream.url, engine, delay=2.0)
        await wait_ready(new_admin, new)
        b = service.add("B", new_port, new_admin)
        await wait_for(lambda: b.ready and b.connections > 0, timeout=20)

        old.send_signal(signal.SIGTERM)
        signalled_at = a.connections
        # The old replica leaves the endpoints, keeps serving what still reaches it, drains and
        # exits on its own; the load never stops.
        await wait_for(lambda: old.poll() is not None, timeout=30)
        old_logs = log_lines(old)
        served_after = load.ok
        await wait_for(lambda: load.ok >= served_after + 50, timeout=20)
    finally:
        load.running = False
        await asyncio.gather(*clients, return_exceptions=True)
        await service.stop()
        stop(old)
        if new is not None:
            new.send_signal(signal.SIGINT)
            new.send_signal(signal.SIGINT)  # the second signal skips the shutdown delay
            try:
                new.wait(15)
            finally:
                stop(new)
    assert load.failures == [], load.failures[:10]
    assert old.returncode == 0
    assert a.refused == 0 and b.refused == 0 and service.no_endpoint == 0
    # The propagation lag really sent new connections to the old replica after its SIGTERM.
    assert a.connections > signalled_at, (signalled_at, a.connections)
    messages = [line["msg"] for line in old_logs]
    assert any(m.startswith("signal received") for m in messages) and messages[-1] == "sidecar stopped", messages
    assert new.returncode == 0


async def test_a_second_signal_ends_the_shutdown_delay(upstream):
    proc, port, admin = start_replica("A", upstream.url, "fast", delay=120.0)
    try:
        await wait_ready(admin, proc)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (await readyz(admin))[0] != 503:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        # Within the delay the proxy still answers.
        assert (await get_on_new_connection(port))[0] == 200
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 15) == 0  # long before the 120 s delay
        messages = [line["msg"] for line in log_lines(proc)]
    finally:
        stop(proc)
    assert "second signal received: ending the shutdown delay" in messages, messages
