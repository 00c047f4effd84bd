"""DirectReads itself (sidecar.engine.direct, compiled build): its relay thread on real sockets,
for what the wire tests in test_direct_io.py cannot arrange on purpose (a leave racing the
thread, a descriptor number reused, a client socket that fills mid-read)."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from sidecar.engine.direct import DirectReads, DirectSocket
from sidecar.engine.relay import CHUNKED, LENGTH, BodyRelay, ClientOutput
from tests.waiting import wait_for as until

pytestmark = pytest.mark.skipif(DirectReads is None, reason="direct socket I/O is compiled only")


class SocketTransport:
    """The client connection's transport, as the relay's :class:`DirectSocket` sees it: a real
    socket to send on, and what was handed to ``write`` (a transport's buffer) recorded."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.writes: list[bytes] = []

    def get_extra_info(self, name: str) -> Any:
        assert name == "socket"
        return self.sock

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return sum(map(len, self.writes))

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))


class Stream:
    """One body on its way: the upstream's socket pair (``up`` is read by the thread, ``origin``
    is the upstream writing), the client's (``ours`` written, ``client`` the client reading),
    the relay, and what the thread handed back to this connection."""

    def __init__(self, direct: Any, mode: int = LENGTH, length: int = 1 << 20, sndbuf: int = 0) -> None:
        self.direct = direct
        self.up, self.origin = socket.socketpair()
        self.ours, self.client = socket.socketpair()
        if sndbuf:
            self.ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
            self.client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
        for s in (self.up, self.ours, self.client):
            s.setblocking(False)
        self.transport = SocketTransport(self.ours)
        self.relay = BodyRelay(ClientOutput(self.transport, DirectSocket(self.transport)), mode, length, 1024)  # type: ignore[arg-type]
        self.enroll_at = 0
        self.calls: list[str] = []
        self.ended: list[bool] = []
        self.entry: Any = None

    def enroll(self, tail: bool = False) -> None:
        self.entry = self.direct.enroll(self, self.up.fileno(), self.relay, tail)
        assert self.entry is not None

    def leave(self) -> Any:
        return self.direct.leave(self.entry, self.up.fileno())

    # What the thread's hand-backs call on the upstream connection.
    def direct_stop(self) -> None:
        self.calls.append("direct_stop")
        self.leave()

    def body_end(self, extra: int) -> None:
        self.ended.append(extra)
        self.leave()

    def invalid_body(self, exc: Exception) -> None:
        self.calls.append(f"invalid: {exc}")
        self.leave()

    def _fail(self, message: str) -> None:
        self.calls.append(f"fail: {message}")
        self.leave()

    def received(self) -> bytes:
        got = bytearray()
        while True:
            try:
                data = self.client.recv(1 << 20)
            except BlockingIOError:
                return bytes(got)
            if not data:
                return bytes(got)
            got += data

    def close(self) -> None:
        for s in (self.up, self.origin, self.ours, self.client):
            s.close()


@pytest.fixture
async def direct() -> Any:
    d = DirectReads(asyncio.get_running_loop())
    yield d
    d.close()


def relay_thread_cpu() -> float:
    """CPU seconds the stream thread has run (there is one while a DirectReads is open)."""
    for task in Path("/proc/self/task").iterdir():
        if (task / "comm").read_text().strip() == "sidecar-streams":
            return int((task / "schedstat").read_text().split()[0]) / 1e9
    raise AssertionError("no stream thread")


async def read_until(stream: Stream, want: bytes, timeout: float = 5) -> bytes:
    got = bytearray()
    async with asyncio.timeout(timeout):
        while len(got) < len(want):
            got += stream.received()
            await asyncio.sleep(0.002)
    return bytes(got)


async def test_reads_within_the_body_go_to_the_client_without_the_loop(direct: Any) -> None:
    s = Stream(direct, LENGTH, 1000)
    try:
        s.enroll()
        s.origin.sendall(b"a" * 100)
        assert await read_until(s, b"a" * 100) == b"a" * 100
        s.origin.sendall(b"b" * 50)
        assert await read_until(s, b"b" * 50) == b"b" * 50
        assert s.transport.writes == [] and s.calls == [] and s.ended == []
        assert s.relay.left == 850 and s.relay.reads == 2  # the exchange's idle timeout sees the reads
        assert direct.reads == 2 and direct.handed_back == 0 and direct.enrolled == 1
    finally:
        s.leave()
        s.close()


async def test_the_last_bytes_it_read_are_kept_when_asked(direct: Any) -> None:
    """Enrolled with ``tail``: the thread keeps a copy of the last 16 KiB it read (the usage
    reader's share of a body's end), in order across its ring's wrap, and counts what it read;
    ``leave`` returns both. Without it, nothing."""
    s = Stream(direct, LENGTH, 1 << 20)
    try:
        s.enroll(tail=True)
        sent = b""
        for n, size in enumerate((100, 9000, 7000, 3000, 20000, 5)):
            piece = bytes([65 + n]) * size
            s.origin.sendall(piece)
            sent += piece
            assert await read_until(s, piece) == piece  # (relayed: the thread read it)
        tail, read = s.leave()
        assert (tail, read) == (sent[-16384:], len(sent))
        plain = Stream(direct, LENGTH, 1000)
        try:
            plain.enroll()
            plain.origin.sendall(b"x" * 10)
            assert await read_until(plain, b"x" * 10) == b"x" * 10
            assert plain.leave() is None
        finally:
            plain.close()
    finally:
        s.close()


async def test_bytes_after_the_bodys_end_hand_the_read_to_the_relay(direct: Any) -> None:
    """A read that goes past the body's end is the loop's: the relay sends the body's part and
    the connection learns bytes followed it (never relayed)."""
    s = Stream(direct, LENGTH, 150)
    try:
        s.enroll()
        s.origin.sendall(b"a" * 100)
        assert await read_until(s, b"a" * 100) == b"a" * 100
        s.origin.sendall(b"b" * 50 + b"NEXT")
        await until(lambda: s.ended)
        assert s.ended == [len(b"NEXT")] and s.relay.done  # the bytes after the body
        assert s.received() == b"b" * 50
        assert direct.reads == 2 and direct.handed_back == 1
    finally:
        s.close()


def blocking_read(stream: Stream, want: bytes, timeout: float = 5) -> bytes:
    """Read the client's side while the event loop is blocked (nothing the loop would send can
    arrive meanwhile)."""
    stream.client.setblocking(True)
    stream.client.settimeout(timeout)
    got = bytearray()
    try:
        while len(got) < len(want):
            data = stream.client.recv(1 << 20)
            assert data, bytes(got)
            got += data
    finally:
        stream.client.setblocking(False)
    return bytes(got)


async def test_a_content_length_bodys_last_read_goes_to_the_client_without_the_loop(direct: Any) -> None:
    """The read that ends the body exactly is sent by the thread, the loop told afterwards: the
    client has it while the loop is blocked, then the connection learns the body ended with
    nothing after it."""
    s = Stream(direct, LENGTH, 150)
    try:
        s.enroll()
        s.origin.sendall(b"a" * 100)
        assert await read_until(s, b"a" * 100) == b"a" * 100
        s.origin.sendall(b"b" * 50)
        assert blocking_read(s, b"b" * 50) == b"b" * 50 and s.ended == []  # (the loop has not run)
        await until(lambda: s.ended)
        assert s.ended == [False] and s.relay.done and s.relay.left == 0 and s.relay.reads == 2
        assert s.transport.writes == [] and s.received() == b""
        assert direct.reads == 2 and direct.handed_back == 1
    finally:
        s.close()


async def test_a_chunked_bodys_end_goes_with_its_last_event_without_the_loop(direct: Any) -> None:
    """A read of whole chunks then the last chunk (no trailer) passes through as it came, sent by
    the thread; the relay is then done at the body's end."""
    s = Stream(direct, CHUNKED, 0)
    try:
        s.enroll()
        first = b"6\r\nevent1\r\n"
        s.origin.sendall(first)
        assert await read_until(s, first) == first
        last = b"7\r\nevent2\n\r\n0\r\n\r\n"
        s.origin.sendall(last)
        assert blocking_read(s, last) == last and s.ended == []
        await until(lambda: s.ended)
        assert s.ended == [False] and s.relay.done and s.relay.reads == 2
        assert s.transport.writes == [] and direct.handed_back == 1
    finally:
        s.close()


@pytest.mark.parametrize(
    ("end", "client_gets", "extra"),
    [
        (b"0\r\nX-Trailer: t\r\n\r\n", b"0\r\n\r\n", 0),  # trailer fields: dropped by the relay
        (b"0;ext=1\r\n\r\n", b"0\r\n\r\n", 0),  # an extension on the last chunk: dropped
        (b"0\r\n\r\nNEXT", b"0\r\n\r\n", 4),  # bytes after the body: never relayed
        (b"00\r\n\r\n", b"00\r\n\r\n", 0),  # a last chunk the thread does not recognise: the relay's
    ],
)
async def test_an_end_other_than_the_plain_last_chunk_is_the_relays(
    direct: Any, end: bytes, client_gets: bytes, extra: int
) -> None:
    s = Stream(direct, CHUNKED, 0)
    try:
        s.enroll()
        s.origin.sendall(b"3\r\nabc\r\n")
        assert await read_until(s, b"3\r\nabc\r\n") == b"3\r\nabc\r\n"
        s.origin.sendall(end)
        await until(lambda: s.ended)
        assert s.ended == [extra] and s.relay.done
        assert s.received() == client_gets
    finally:
        s.close()


async def test_a_last_read_the_client_socket_cannot_take_ends_through_the_transport(direct: Any) -> None:
    """The read that ends the body finds the client's socket full: it goes to the client's
    transport (in order, after what the socket holds) and the body still ends."""
    s = Stream(direct, LENGTH, 100, sndbuf=4096)
    try:
        s.enroll()
        filler = 0
        while True:  # the client does not read: fill its socket
            try:
                filler += s.ours.send(b"f" * 4096)
            except BlockingIOError:
                break
        s.origin.sendall(b"z" * 100)
        await until(lambda: s.ended)
        assert s.ended == [False] and s.relay.done and direct.handed_back == 1
        assert s.transport.writes == [b"z" * 100]  # (the transport's buffer: after the socket's bytes)
        assert s.received() == b"f" * filler
    finally:
        s.close()


async def test_a_body_end_the_thread_sent_is_settled_before_its_note_reaches_the_loop(direct: Any) -> None:
    """The client has the body's last byte and leaves while the loop has not taken the thread's
    note yet: ``settle`` ends the body then and there, and the note, taken later, changes nothing."""
    s = Stream(direct, CHUNKED, 0)
    try:
        s.enroll()
        s.origin.sendall(b"3\r\nabc\r\n")
        assert await read_until(s, b"3\r\nabc\r\n") == b"3\r\nabc\r\n"
        last = b"3\r\ndef\r\n0\r\n\r\n"
        s.origin.sendall(last)
        assert blocking_read(s, last) == last and s.ended == []  # (the loop has not run)
        direct.settle(s.entry)  # (waits for the thread to be done with the read it sent)
        assert s.ended == [False] and s.relay.done and direct.handed_back == 1
        await asyncio.sleep(0.05)  # the loop takes the note: nothing more happens
        assert s.ended == [False] and s.calls == []
    finally:
        s.close()


def blocking_until(condition: Any, timeout: float = 5) -> None:
    """Wait for ``condition()`` with the event loop blocked (the thread's notes stay queued)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.001)


async def test_a_body_end_the_client_socket_did_not_take_whole_is_not_settled(direct: Any) -> None:
    """The read that ends the body finds the client's socket full: the rest waits for the
    client's transport, so ``settle`` ends nothing; the loop ends the body when it takes the note."""
    s = Stream(direct, LENGTH, 100, sndbuf=4096)
    try:
        s.enroll()
        while True:  # the client does not read: fill its socket
            try:
                s.ours.send(b"f" * 4096)
            except BlockingIOError:
                break
        s.origin.sendall(b"z" * 100)
        blocking_until(lambda: direct.handed_back == 1)
        direct.settle(s.entry)
        assert s.ended == [] and s.transport.writes == []
        await until(lambda: s.ended)
        assert s.ended == [False] and s.transport.writes == [b"z" * 100]
    finally:
        s.close()


async def test_a_body_whose_end_has_not_gone_out_is_not_settled(direct: Any) -> None:
    """A client that leaves mid-body left it: ``settle`` ends nothing and the thread goes on."""
    s = Stream(direct, LENGTH, 100)
    try:
        s.enroll()
        s.origin.sendall(b"z" * 50)
        assert await read_until(s, b"z" * 50) == b"z" * 50
        direct.settle(s.entry)
        assert s.ended == [] and s.calls == []
        s.origin.sendall(b"z" * 50)  # still relayed by the thread, to the body's end
        assert await read_until(s, b"z" * 50) == b"z" * 50
        await until(lambda: s.ended)
        assert s.ended == [False] and direct.handed_back == 1 and s.transport.writes == []
    finally:
        s.close()


def epoll_sets_holding(fd: int) -> list[int]:
    """The epoll descriptors of this process whose sets hold ``fd`` (by its number)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") != "anon_inode:[eventpoll]":
                continue
            lines = Path(f"/proc/self/fdinfo/{name}").read_text().splitlines()
        except OSError:
            continue
        if any(line.split()[:2] == ["tfd:", str(fd)] for line in lines):
            found.append(int(name))
    return found


async def test_an_enrolled_socket_leaves_the_event_loops_epoll_set_until_reading_resumes(direct: Any) -> None:
    """A paused transport's socket stays in libuv's epoll set until its next event, which would
    wake the loop at the thread's first read of every stream: unwatch takes it out at once, the
    thread's reads never reach the transport, and resuming puts it back."""
    loop = asyncio.get_running_loop()
    s = Stream(direct, LENGTH, 1000)
    got: list[bytes] = []

    class Upstream(asyncio.Protocol):
        def data_received(self, data: bytes) -> None:
            got.append(data)

    transport, _ = await loop.connect_accepted_socket(Upstream, s.up)
    fd = s.up.fileno()
    try:
        await asyncio.sleep(0.02)  # (libuv adds a socket to its set at its next poll)
        assert epoll_sets_holding(fd)
        s.enroll()
        transport.pause_reading()
        direct.unwatch(fd)
        assert epoll_sets_holding(fd) == []
        s.origin.sendall(b"x" * 10)
        assert await read_until(s, b"x" * 10) == b"x" * 10 and got == []
        s.leave()
        transport.resume_reading()
        await until(lambda: epoll_sets_holding(fd) != [])
        s.origin.sendall(b"y")
        await until(lambda: got)
        assert got == [b"y"] and s.received() == b""
    finally:
        transport.close()
        await asyncio.sleep(0)
        for sock in (s.origin, s.ours, s.client):
            sock.close()


async def test_a_leave_returns_only_once_the_thread_is_done_with_the_connection(direct: Any) -> None:
    """Bytes sent right around a leave: once it returns, nothing more reaches the client, and
    what the thread did not read stays in the upstream's socket."""
    s = Stream(direct, LENGTH, 1 << 30)
    try:
        s.enroll()
        for i in range(200):
            s.origin.sendall(b"%04d" % i)
            if i == 100:
                s.leave()
                relayed = s.relay.reads
        await asyncio.sleep(0.05)
        got = s.received()
        rest = s.up.recv(1 << 20)
        assert got + rest == b"".join(b"%04d" % i for i in range(200))  # nothing lost, nothing twice
        assert s.relay.reads == relayed and s.transport.writes == []
        s.origin.sendall(b"late")
        before = relay_thread_cpu()
        await asyncio.sleep(0.05)
        assert relay_thread_cpu() - before < 0.01  # the socket left the set: no wakeups for it
        assert s.received() == b"" and s.up.recv(16) == b"late"
    finally:
        s.close()


async def test_a_descriptor_number_reused_after_the_loop_closed_it_gets_nothing(direct: Any) -> None:
    """The loop closes the client's socket (a client gone) before the connection leaves, and a
    new connection gets the same descriptor number: the thread's bytes never reach it (it sends
    on a descriptor of its own, which still names the old socket)."""
    s = Stream(direct, LENGTH, 1 << 20)
    s.enroll()
    fd = s.ours.fileno()
    s.ours.close()
    fresh, fresh_peer = socket.socketpair()
    try:
        if fresh.fileno() != fd and fresh_peer.fileno() != fd:
            pytest.skip("the descriptor number was not reused")
        fresh_peer.setblocking(False)
        fresh.setblocking(False)
        s.origin.sendall(b"secret" * 100)
        await until(lambda: direct.reads >= 1)
        await asyncio.sleep(0.02)
        for sock in (fresh, fresh_peer):
            with pytest.raises(BlockingIOError):
                sock.recv(1 << 16)
        assert s.received() == b"secret" * 100  # the old socket got them: it is still open through the thread's
        s.leave()
        assert s.client.recv(16) == b""  # and it is closed once the connection left
    finally:
        fresh.close()
        fresh_peer.close()
        for sock in (s.up, s.origin, s.client):
            sock.close()


async def test_a_client_socket_that_fills_hands_the_rest_to_its_transport_in_order(direct: Any) -> None:
    """The client's socket takes part of a read: the rest goes to the transport (its buffer,
    then backpressure), the connection leaves the thread, and the client's bytes are the
    upstream's, in order."""
    s = Stream(direct, LENGTH, 1 << 30, sndbuf=4096)
    s.origin.setblocking(False)
    try:
        s.enroll()
        sent = bytes(range(256)) * 4096  # 1 MiB: more than the client's socket buffers hold
        sender = asyncio.ensure_future(asyncio.get_running_loop().sock_sendall(s.origin, sent))
        await until(lambda: s.calls)
        assert s.calls == ["direct_stop"] and direct.handed_back == 1
        assert s.transport.writes  # the rest of that read, for the transport
        rest = bytearray()  # what the transport would read next: the thread left
        async with asyncio.timeout(5):
            while True:
                try:
                    data = s.up.recv(1 << 20)
                except BlockingIOError:
                    if sender.done():
                        break
                    await asyncio.sleep(0.002)
                    continue
                rest += data
        await sender
        assert s.received() + b"".join(s.transport.writes) + bytes(rest) == sent
    finally:
        s.close()


async def test_chunks_pass_through_and_a_chunk_the_thread_cannot_pass_goes_to_the_relay(direct: Any) -> None:
    """Whole chunks pass as they came, a chunk cut in a size line or carrying an extension is
    the relay's (which drops the extension), and the thread takes the body back after it."""
    s = Stream(direct, CHUNKED, 0)
    try:
        s.enroll()
        out = b""
        for i in range(6):  # passes enough for the thread to take it back after a hand-back
            event = b"data: %d\n\n" % i
            chunk = b"%x\r\n%s\r\n" % (len(event), event)
            s.origin.sendall(chunk)
            out += chunk
            assert await read_until(s, chunk) == chunk
        assert direct.handed_back == 0
        s.origin.sendall(b"5;ext=1\r\nhello\r\n")
        assert await read_until(s, b"5\r\nhello\r\n") == b"5\r\nhello\r\n"
        assert direct.handed_back == 1
        reads = direct.reads
        s.origin.sendall(b"3\r\nabc\r\n")
        assert await read_until(s, b"3\r\nabc\r\n") == b"3\r\nabc\r\n"
        assert direct.reads == reads + 1 and direct.handed_back == 1 and s.calls == []  # the thread's again
        s.origin.sendall(b"0\r\n\r\n")
        await until(lambda: s.ended)
        assert s.ended == [False] and s.received() == b"0\r\n\r\n"
    finally:
        s.close()


async def test_a_body_handed_back_early_goes_to_its_transport_for_a_while(direct: Any) -> None:
    """A hand-back after fewer passes than the thread needs to be worth it (extensions on every
    chunk): the connection goes back to its transport, and enrolling waits some reads."""
    s = Stream(direct, CHUNKED, 0)
    try:
        s.relay.reads = 3
        s.enroll()
        s.origin.sendall(b"5;x\r\nhello\r\n")
        await until(lambda: s.calls)
        assert s.calls == ["direct_stop"] and s.enroll_at > s.relay.reads
        assert await read_until(s, b"5\r\nhello\r\n") == b"5\r\nhello\r\n"
    finally:
        s.close()


async def test_invalid_framing_is_the_relays_and_nothing_of_it_is_sent(direct: Any) -> None:
    s = Stream(direct, CHUNKED, 0)
    try:
        s.enroll()
        s.origin.sendall(b"zz\r\nhello\r\n")
        await until(lambda: s.calls)
        assert s.calls[0].startswith("invalid: ") and s.received() == b""
    finally:
        s.close()


async def test_an_upstream_close_goes_back_to_its_transport(direct: Any) -> None:
    s = Stream(direct, LENGTH, 100)
    try:
        s.enroll()
        s.origin.close()
        await until(lambda: s.calls)
        assert s.calls == ["direct_stop"] and s.received() == b"" and s.relay.reads == 0
    finally:
        s.close()


async def test_closing_stops_the_thread_and_relays_nothing_more() -> None:
    direct = DirectReads(asyncio.get_running_loop())
    s = Stream(direct, LENGTH, 1 << 20)
    try:
        s.enroll()
        s.origin.sendall(b"x")
        assert await read_until(s, b"x") == b"x"
        direct.close()
        s.origin.sendall(b"y")
        await asyncio.sleep(0.05)
        assert s.received() == b"" and s.up.recv(16) == b"y"
        s.leave()  # (after the close: nothing to do)
        direct.close()
    finally:
        s.close()


async def test_near_the_open_file_limit_bodies_stay_with_their_transports() -> None:
    """The thread's two descriptors per stream stop at three quarters of the open file limit:
    the rest is kept for accepting and connecting (the transport reads such a body instead)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[socket.socket] = []
    s: Stream | None = None
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 200, hard))
    try:
        direct = DirectReads(asyncio.get_running_loop())
        s = Stream(direct, LENGTH, 1000)
        cap = resource.getrlimit(resource.RLIMIT_NOFILE)[0] * 3 // 4
        while True:  # the lowest free descriptor number reaches the cap
            probe = os.dup(0)
            os.close(probe)
            if probe >= cap:
                break
            fillers.append(socket.socket())
        assert direct.enroll(s, s.up.fileno(), s.relay) is None
        for f in fillers[-10:]:
            f.close()
        del fillers[-10:]
        s.enroll()  # descriptors free below the cap again
        s.origin.sendall(b"x")
        assert await read_until(s, b"x") == b"x"
        s.leave()
        direct.close()
    finally:
        for f in fillers:
            f.close()
        if s is not None:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
