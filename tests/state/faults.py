"""A TCP proxy between sidecars and redis-server that injects the faults a production store shows:
a reply that arrives after the caller gave up (a fork, an fsync stall, a retransmit), and a
connection that stays open but delivers nothing (an expired NAT / conntrack / IPVS entry).

It runs on the test's event loop, bound to 127.0.0.1; the replicas' ``state.url`` points at it.
Faults are armed by what passes through, never by the clock:

- :meth:`FaultProxy.delay_reply_with` holds back the first reply chunk that contains a marker
  (a session id the reply names; events on subscription connections do not count) for
  ``seconds``, then forwards it (to a caller that has usually given up and closed by then);
- :meth:`FaultProxy.silence_subscriptions` makes every connection that sent ``SUBSCRIBE`` deaf:
  it stays open, nothing is forwarded either way;
- :meth:`FaultProxy.blackhole` resets every open connection and then accepts new ones that never
  answer (a store that hangs after a failure: a probe waits its whole timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field


@dataclass
class _Delay:
    marker: bytes
    seconds: float
    fired: asyncio.Event = field(default_factory=asyncio.Event)


class FaultProxy:
    """``await FaultProxy.start(redis_port)``; ``url`` is what the replicas use."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.server: asyncio.Server | None = None
        self.port = 0
        self._delays: list[_Delay] = []
        self._deaf = False
        self._blackhole = False
        self._subscribers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @classmethod
    async def start(cls, target_port: int) -> FaultProxy:
        proxy = cls(target_port)
        proxy.server = await asyncio.start_server(proxy._accept, "127.0.0.1", 0)
        proxy.port = proxy.server.sockets[0].getsockname()[1]
        return proxy

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def delay_reply_with(self, marker: str, seconds: float) -> asyncio.Event:
        """Hold the next server reply chunk containing ``marker`` for ``seconds``; the returned
        event is set once that reply was held (the store had acted by then)."""
        delay = _Delay(marker.encode(), seconds)
        self._delays.append(delay)
        return delay.fired

    def blackhole(self) -> None:
        """Reset the open connections; from now on new ones are accepted and never answered."""
        self._blackhole = True
        for w in list(self._writers):
            w.transport.abort()

    def restore(self) -> None:
        """New connections reach the store again (those held in the blackhole stay dead)."""
        self._blackhole = False

    def silence_subscriptions(self) -> None:
        """From now on every subscription connection is open and deaf."""
        self._deaf = True

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for w in list(self._writers):
            w.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        if self._blackhole:
            return  # (held open until the proxy closes)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        for coro in (self._upward(reader, up_writer, writer), self._downward(up_reader, writer)):
            task = asyncio.get_running_loop().create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _deafened(self, client: asyncio.StreamWriter) -> bool:
        return self._deaf and client in self._subscribers

    async def _upward(
        self, reader: asyncio.StreamReader, up: asyncio.StreamWriter, client: asyncio.StreamWriter
    ) -> None:
        try:
            while data := await reader.read(65536):
                if b"SUBSCRIBE" in data.upper():
                    self._subscribers.add(client)
                if self._deafened(client):
                    continue
                up.write(data)
                await up.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            up.close()

    async def _downward(self, up: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        try:
            while data := await up.read(65536):
                for delay in self._delays if client not in self._subscribers else ():
                    if delay.marker in data:
                        self._delays.remove(delay)
                        delay.fired.set()
                        await asyncio.sleep(delay.seconds)
                        break
                if self._deafened(client):
                    continue
                client.write(data)
                await client.drain()
        except OSError:
            pass
        finally:
            client.close()
