"""Randomized integrity of streamed bodies on the wire, both engines: many keep-alive clients run
requests back to back against an upstream whose answers vary in framing (chunked with random
chunk sizes, extensions and trailers; Content-Length; ended by the close), are written in random
splits and pauses, and sometimes break off (a close or a reset mid-body). Some clients leave
mid-body, some read slowly, some speak HTTP/1.0.

What must hold whatever the timing: every answer a client takes as complete is byte for byte the
upstream's; an answer the upstream broke off is never passed off as complete (but where the
close itself ends the body, which nobody can tell from a clean end); no answer is lost that the
upstream completed and the client waited for; and the sidecar keeps no connection or descriptor
of them afterwards. The seeds are fixed; the interleaving is not, which is the point.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httptools

from tests.engine import RawMessage, reset

SEEDS = range(8)  # client connections
REQUESTS = 40  # per connection
PIECE_SIZES = (1, 2, 7, 100, 1000, 5000, 20000, 70000)
# Data that looks like framing, so that a relay that parses what it should pass shows it.
FILLERS = (b"data: x\n\n", b"\r\n0\r\n\r\n", b"0;ext\r\n", bytes(range(256)))


@dataclass
class Plan:
    """One answer, all from its seed: the upstream writes it, the client checks it."""

    framing: str  # "chunked", "length" or "close"
    pieces: list[bytes]
    extensions: bool
    trailers: bool
    fail_at: int | None  # the piece after which the upstream breaks off
    fail_by: str  # "close" or "reset"
    pauses: list[float]
    splits: bool

    @property
    def body(self) -> bytes:
        return b"".join(self.pieces)


def plan(seed: int) -> Plan:
    r = random.Random(seed)
    pieces = []
    for _ in range(r.choice([1, 2, 3, 5, 10, 30])):
        size = r.choice(PIECE_SIZES)
        filler = r.choice(FILLERS)
        pieces.append((filler * (size // len(filler) + 1))[:size])
    fails = r.random() < 0.15
    return Plan(
        framing=r.choice(["chunked", "chunked", "length", "close"]),
        pieces=pieces,
        extensions=r.random() < 0.15,
        trailers=r.random() < 0.15,
        fail_at=r.randrange(len(pieces)) if fails else None,
        fail_by=r.choice(["close", "reset"]),
        pauses=[r.choice([0, 0, 0, 0.001, 0.005]) for _ in pieces],
        splits=r.random() < 0.3,
    )


async def answer(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """The upstream: ``GET /s?seed=N`` answered as :func:`plan` says."""
    seed = int(req.target.split("seed=")[1])
    p = plan(seed)
    r = random.Random(-seed)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    head += {
        "chunked": b"Transfer-Encoding: chunked\r\n",
        "length": b"Content-Length: %d\r\n" % len(p.body),
        "close": b"Connection: close\r\n",
    }[p.framing] + b"\r\n"
    out = head
    for i, piece in enumerate(p.pieces):
        if p.framing == "chunked":
            out += b"%x%s\r\n%s\r\n" % (len(piece), b";a=b" if p.extensions and i % 3 == 0 else b"", piece)
        else:
            out += piece
        if p.fail_at == i:
            writer.write(out[: r.randrange(len(out))])
            await writer.drain()
            if p.fail_by == "reset":
                reset(writer)
            return False
        if p.splits and len(out) > 1:
            cut = r.randrange(1, len(out))
            writer.write(out[:cut])
            await writer.drain()
            out = out[cut:]
        writer.write(out)
        await writer.drain()
        out = b""
        if p.pauses[i]:
            await asyncio.sleep(p.pauses[i])
    if p.framing == "chunked":
        writer.write(b"0\r\n" + (b"X-T: 1\r\n" if p.trailers else b"") + b"\r\n")
        await writer.drain()
    return p.framing != "close"


class Client(asyncio.Protocol):
    """One keep-alive client connection; :meth:`run` sends one request and says how it ended."""

    def __init__(self, rng: random.Random, tally: Counter[str]) -> None:
        self.rng = rng
        self.tally = tally
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[str] | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.http10 = False
        self.leave_after: int | None = None
        self.received = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.done is not None and not self.done.done():
            # An HTTP/1.0 answer without a length ends with the connection.
            clean = exc is None and self.http10 and self.parser.get_status_code() == 200
            self.done.set_result("ended by close" if clean else "lost")

    def data_received(self, data: bytes) -> None:
        assert self.done is not None and self.transport is not None
        self.received += len(data)
        if self.leave_after is not None and self.received >= self.leave_after:
            if self.rng.random() < 0.5:
                sock = self.transport.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.close()
            self.done.set_result("left")
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.done.set_result(f"unparsable answer: {exc}")
            self.transport.close()
            return
        if self.slow and self.rng.random() < 0.3:
            self.transport.pause_reading()
            asyncio.get_running_loop().call_later(self.rng.choice([0.001, 0.01]), self._resume)

    def _resume(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.done is not None
        if not self.done.done():
            self.done.set_result("complete")

    async def run(self, seed: int) -> bool:
        """One request; whether the connection can carry the next."""
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self.body, self.received = [], 0
        self.http10 = self.rng.random() < 0.08
        self.slow = self.rng.random() < 0.1
        self.leave_after = self.rng.randrange(1, 100_000) if self.rng.random() < 0.07 else None
        self.done = asyncio.get_running_loop().create_future()
        version = b"1.0" if self.http10 else b"1.1"
        self.transport.write(
            b"GET /s?seed=%d HTTP/%s\r\nHost: x\r\nX-Correlation-ID: s-%d\r\n\r\n" % (seed, version, seed)
        )
        how = await asyncio.wait_for(self.done, 30)
        p = plan(seed)
        got = b"".join(self.body)
        cut_by_close = p.fail_at is not None and (p.framing == "close" and p.fail_by == "close" or self.http10)
        if how in ("complete", "ended by close") and self.parser.get_status_code() == 200:
            if cut_by_close:  # a close ends such a body: nobody can tell it from the whole
                self.tally["cut by a close"] += 1
            elif p.fail_at is not None:
                self.tally[f"broken-off answer passed off as complete (seed {seed})"] += 1
            elif got != p.body:
                self.tally[f"answer corrupted (seed {seed}: {len(got)} of {len(p.body)} bytes)"] += 1
            else:
                self.tally["whole"] += 1
        elif how == "complete":  # an error the sidecar answered itself: the upstream broke off first
            self.tally["error answer" if p.fail_at is not None else f"error answer (seed {seed})"] += 1
        elif how == "left":
            self.tally["client left"] += 1
        elif how == "lost" and p.fail_at is not None:
            self.tally["cut (the client can tell)"] += 1
        else:
            self.tally[f"{how} (seed {seed}, {p.framing}, http10 {self.http10})"] += 1
        return how == "complete" and not self.http10 and self.parser.should_keep_alive()


async def client(port: int, seed: int, tally: Counter[str]) -> None:
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    conn: Client | None = None
    for i in range(REQUESTS):
        if conn is None or conn.transport is None:
            conn = Client(rng, tally)
            await loop.create_connection(lambda c=conn: c, "127.0.0.1", port)  # type: ignore[misc]
        if not await conn.run(seed * 1000 + i):
            if conn.transport is not None:
                conn.transport.close()
            conn = None
    if conn is not None and conn.transport is not None:
        conn.transport.close()


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_streamed_answers_are_whole_or_visibly_cut_under_random_breaks_and_clients(
    raw_upstream: Any, start_sidecar: Any
) -> None:
    up = await raw_upstream({"/s": answer})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False)
    port = int(sc.proxy_url.rsplit(":", 1)[1])
    before = open_descriptors()
    tally: Counter[str] = Counter()
    await asyncio.gather(*(client(port, seed, tally) for seed in SEEDS))
    expected = {"whole", "cut by a close", "error answer", "client left", "cut (the client can tell)"}
    assert set(tally) <= expected, tally
    assert tally["whole"] >= len(SEEDS) * REQUESTS // 2, tally  # (most answers are plain)
    await up.stop()  # the upstream's connections close: the sidecar must keep none of them
    async with asyncio.timeout(5):
        while open_descriptors() > before:
            await asyncio.sleep(0.02)
