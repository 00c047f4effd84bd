"""Wire helpers for the engine tests: a scripted raw upstream and a raw HTTP/1.1 client.

Both sides are written by hand on asyncio streams (no HTTP library) so the tests see exactly
the bytes each engine puts on the wire: header case and order, framing, chunk boundaries.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson

# A chunked body with what a relay drops or must track across reads: sizes with leading zeros, an
# extension, a last chunk with trailer fields; as passed through to an HTTP/1.1 client (less the
# extension and the trailers) and as its data alone (for an HTTP/1.0 client).
CUT_STREAM = (
    b"4\r\nabcd\r\n"
    + b'A;ext="q;\\""; e2\r\n'
    + bytes(range(32, 42))
    + b"\r\n"
    + b"000b\r\nhello world\r\n"
    + b"00;last\r\nTrailer-A: 1\r\nTrailer-B: 2\r\n\r\n"
)
CUT_THROUGH = b"4\r\nabcd\r\n" + b"A\r\n" + bytes(range(32, 42)) + b"\r\n" + b"000b\r\nhello world\r\n" + b"00\r\n\r\n"
CUT_DATA = b"abcd" + bytes(range(32, 42)) + b"hello world"


@dataclass
class RawMessage:
    """One HTTP/1.1 message as read off the wire (body de-chunked; ``framing`` says how it came)."""

    start: str  # request line or status line
    headers: list[tuple[str, str]]
    body: bytes
    framing: str  # "length", "chunked", "close", "none"
    chunks: list[bytes] = field(default_factory=list)  # chunk payloads, when chunked
    conn: int = 0  # upstream side: which accepted connection carried it (1-based)

    @property
    def method(self) -> str:
        return self.start.split(" ", 1)[0]

    @property
    def target(self) -> str:
        return self.start.split(" ")[1]

    @property
    def status(self) -> int:
        return int(self.start.split(" ")[1])

    def header(self, name: str) -> str | None:
        values = self.all(name)
        return values[0] if values else None

    def all(self, name: str) -> list[str]:
        low = name.lower()
        return [v for k, v in self.headers if k.lower() == low]


class WireError(Exception):
    """The peer closed or sent something that is not HTTP/1.1."""


async def read_head(reader: asyncio.StreamReader) -> tuple[str, list[tuple[str, str]]]:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        raise WireError(f"closed before a complete head: {exc.partial!r}") from None
    lines = raw[:-4].decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.append((name, value.strip()))
    return lines[0], headers


async def read_body(
    reader: asyncio.StreamReader, headers: list[tuple[str, str]], *, is_request: bool, no_body: bool = False
) -> tuple[bytes, str, list[bytes]]:
    """Read a body framed as ``headers`` say. Requests without framing have no body."""
    lows = {k.lower(): v for k, v in headers}
    if no_body:
        return b"", "none", []
    if "chunked" in lows.get("transfer-encoding", "").lower():
        chunks = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                return b"".join(chunks), "chunked", chunks
            chunks.append(await reader.readexactly(size))
            if await reader.readexactly(2) != b"\r\n":
                raise WireError("chunk not followed by CRLF")
    if "content-length" in lows:
        return await reader.readexactly(int(lows["content-length"])), "length", []
    if is_request:
        return b"", "none", []
    return await reader.read(), "close", []


async def read_response(reader: asyncio.StreamReader, *, head: bool = False) -> RawMessage:
    """One response; ``head=True`` when it answers a HEAD request. 1xx interim responses are skipped."""
    while True:
        start, headers = await read_head(reader)
        status = int(start.split(" ")[1])
        if status >= 200:
            break
    no_body = head or status in (204, 304)
    body, framing, chunks = await read_body(reader, headers, is_request=False, no_body=no_body)
    return RawMessage(start, headers, body, framing, chunks)


async def exchange(
    port: int, data: bytes, *, responses: int = 1, head: bool = False, timeout: float = 5.0
) -> tuple[list[RawMessage], bool]:
    """Send raw bytes, read ``responses`` responses; also report whether the proxy then closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        out = []
        async with asyncio.timeout(timeout):
            for _ in range(responses):
                out.append(await read_response(reader, head=head))
        closed = await closed_soon(reader, 0.5)
        return out, closed
    finally:
        writer.close()


async def closed_soon(reader: asyncio.StreamReader, within: float) -> bool:
    """True when the peer closes (EOF or reset) within ``within`` seconds without sending more. (A
    broken pipe counts too: the test's own write, for example a dribbled head, met the peer's
    close first, and the stream's reader then raises that error instead of reading the EOF.)"""
    try:
        extra = await asyncio.wait_for(reader.read(1), within)
    except TimeoutError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True
    if extra:
        raise WireError(f"unexpected bytes after the response: {extra!r}")
    return True


async def refused_or_closed(port: int, data: bytes, timeout: float = 5.0) -> tuple[RawMessage | None, bool]:
    """Send malformed bytes: the answer (if any) and whether the connection was closed after it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        try:
            async with asyncio.timeout(timeout):
                resp = await read_response(reader)
        except (WireError, ConnectionResetError):
            return None, True
        return resp, await closed_soon(reader, 1.0)
    finally:
        writer.close()


# A handler answers one parsed request on the raw upstream; it returns False to close the connection.
Handler = Callable[[RawMessage, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


def reset(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s connection with a reset (RST), not a FIN: SO_LINGER 0, then abort."""
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def reply(data: bytes, *, keep: bool = True) -> Handler:
    """A handler that writes fixed bytes."""

    async def handle(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(data)
        await writer.drain()
        return keep

    return handle


async def hang(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Never answer; return when the proxy closes the connection."""
    await reader.read()
    return False


def echo(delay: float = 0.0) -> Handler:
    """Answer with the request target and body size, after ``delay`` seconds."""

    async def handle(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if delay:
            await asyncio.sleep(delay)
        body = orjson.dumps({"target": req.target, "bytes": len(req.body)})
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        return True

    return handle


OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'


class RawUpstream:
    """An upstream on 127.0.0.1 that records every request exactly and answers by path.

    ``routes`` maps a path (the request target without query) to a handler; unknown paths get
    ``OK``. ``read_body=False`` leaves request bodies unread (to make a sender block).
    """

    def __init__(self, routes: dict[str, Handler] | None = None, *, read_body: bool = True) -> None:
        self.routes = routes or {}
        self.read_body = read_body
        self.received: list[RawMessage] = []
        self.connections = 0
        self.closed_at: dict[int, float] = {}  # connection number -> monotonic time it closed
        self.arrived = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> RawUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.close()
        await asyncio.sleep(0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        self._writers.add(writer)
        try:
            while True:
                try:
                    start, headers = await read_head(reader)
                except (WireError, ConnectionResetError):
                    break
                req = RawMessage(start, headers, b"", "none", conn=number)
                if self.read_body:
                    try:
                        req.body, req.framing, req.chunks = await read_body(reader, headers, is_request=True)
                    except (asyncio.IncompleteReadError, ConnectionResetError):
                        break  # an incomplete request is never recorded
                self.received.append(req)
                self.arrived.set()
                handler = self.routes.get(req.target.split("?")[0], reply(OK))
                try:
                    if not await handler(req, reader, writer):
                        break
                except (ConnectionResetError, BrokenPipeError):
                    break
        finally:
            self.closed_at[number] = time.monotonic()
            self._writers.discard(writer)
            writer.close()
