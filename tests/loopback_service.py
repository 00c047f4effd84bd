"""A Kubernetes Service on loopback, for rollout tests: a TCP load balancer in front of sidecar
processes that sends each new client connection to a backend currently listed as ready.

Like kube-proxy, it balances connections, not requests (an established connection stays with
its backend), and it learns readiness late: every ``period`` seconds it reads each backend's
``/readyz``, and what it read takes effect ``lag`` seconds later (the endpoint update travelling
to every node). A connection that finds no ready backend, or whose backend refuses it, is closed
at once: the client sees the failure a refused pod would cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Backend:
    name: str
    port: int  # proxy listener
    admin_url: str
    ready: bool = False  # as the balancer currently believes
    connections: int = 0  # client connections sent here
    refused: int = 0  # connections this backend refused


@dataclass
class LoopbackService:
    period: float = 0.15
    lag: float = 0.5
    backends: list[Backend] = field(default_factory=list)
    no_endpoint: int = 0  # client connections closed because no backend was ready
    port: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _rr: itertools.count[int] = field(default_factory=itertools.count)

    async def start(self) -> LoopbackService:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self._spawn(self._watch())
        return self

    def add(self, name: str, port: int, admin_url: str) -> Backend:
        """A new endpoint, not ready until its /readyz says so."""
        backend = Backend(name, port, admin_url)
        self.backends.append(backend)
        return backend

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- endpoints -------------------------------------------------------------------------------

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                for backend in list(self.backends):
                    ready = await _probe(http, backend.admin_url)
                    if ready != backend.ready:
                        loop.call_later(self.lag, setattr, backend, "ready", ready)
                await asyncio.sleep(self.period)

    # -- traffic ---------------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ready = [b for b in self.backends if b.ready]
        if not ready:
            self.no_endpoint += 1
            writer.transport.abort()
            return
        backend = ready[next(self._rr) % len(ready)]
        backend.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", backend.port)
        except OSError:
            backend.refused += 1
            writer.transport.abort()  # the client sees a reset, as from a pod that refused it
            return
        self._spawn(_relay(reader, writer, up_reader, up_writer))


async def _probe(http: aiohttp.ClientSession, admin_url: str) -> bool:
    try:
        async with http.get(admin_url + "/readyz") as resp:
            await resp.read()
            return resp.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False


async def _relay(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
) -> None:
    try:
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    finally:
        writer.close()
        up_writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction; pass a half-close on as a half-close and a reset as a reset."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof() and not writer.transport.is_closing():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()
