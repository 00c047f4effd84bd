"""DirectSocket's gathering write (compiled build): the pieces reach the peer as their join, in
order, whether the socket takes them at once, takes part of them (the rest then goes through the
transport, and later writes queue behind it), or there are more of them than one sendmsg gathers.
Real sockets on 127.0.0.1; the peer reads what arrived."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sidecar.engine.direct import DirectSocket

pytestmark = pytest.mark.skipif(DirectSocket is None, reason="direct socket I/O is compiled only")


@contextlib.asynccontextmanager
async def connected() -> AsyncIterator[tuple[asyncio.Transport, asyncio.StreamReader]]:
    """The client side's transport (what DirectSocket writes through) and the server side's
    reader; everything closed on the way out."""
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = loop.create_future()

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result((reader, writer))

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
    reader, writer = await asyncio.wait_for(accepted, 5)
    try:
        yield transport, reader
    finally:
        transport.close()
        writer.close()
        await writer.wait_closed()
        server.close()
        await server.wait_closed()


async def read(reader: asyncio.StreamReader, n: int) -> bytes:
    return await asyncio.wait_for(reader.readexactly(n), 10)


async def test_pieces_leave_in_one_write_as_their_join() -> None:
    async with connected() as (transport, reader):
        sock = DirectSocket(transport)
        parts = [b"HTTP/1.1 200 OK\r\n", b"A: 1\r\n", b"", b"\r\n", b"x" * 1000]
        sock.writev(parts)
        assert transport.get_write_buffer_size() == 0  # the socket took all of it: nothing queued
        assert await read(reader, 1025) == b"".join(parts)


async def test_what_the_socket_does_not_take_follows_through_the_transport_in_order() -> None:
    async with connected() as (transport, reader):
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock = DirectSocket(transport)
        big = [bytes([65 + i]) * 100_000 for i in range(8)]  # far more than the socket buffers
        sock.writev(big)
        assert transport.get_write_buffer_size() > 0  # the rest went to the transport
        sock.writev([b"tail-", b"end"])  # queued behind it, not sent ahead of it
        sock.writev([b"!"])
        sock.write(b"?")
        expected = b"".join(big) + b"tail-end!?"
        assert await read(reader, len(expected)) == expected


async def test_more_pieces_than_one_sendmsg_gathers_and_pieces_that_are_not_bytes() -> None:
    async with connected() as (transport, reader):
        sock = DirectSocket(transport)
        many = [b"%d," % i for i in range(200)]
        mixed: list[Any] = [b"a", bytearray(b"b"), memoryview(b"c")]
        sock.writev(many)
        sock.writev(mixed)
        expected = b"".join(many) + b"abc"
        assert await read(reader, len(expected)) == expected
