"""Fixtures of the TLS tests: a CA, certificates and TLS upstreams on loopback, made per run.

Every test here runs on the default asyncio loop and on uvloop (what ``sidecar run`` uses):
their TLS transports are separate implementations, and the fast engine's pool relies on how
they report a close.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme
import uvloop
from aiohttp import web

from tests.engine import Handler, RawUpstream
from tests.upstream import RecordingUpstream

SERVER_NAME = "upstream.test"


@pytest.hookimpl(optionalhook=True)
def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """The tests of this directory run once per event loop implementation."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@dataclass(frozen=True)
class Pki:
    """A CA of the test run, what it issued (as PEM files), and a CA nobody trusts."""

    ca: trustme.CA
    server: trustme.LeafCert  # for upstream.test and 127.0.0.1
    named: trustme.LeafCert  # for upstream.test only
    ca_file: str
    other_ca_file: str  # a CA that issued none of these
    cert_file: str  # client certificate of the sidecar, for mutual TLS
    key_file: str
    other_key_file: str  # a valid key that is not the client certificate's
    foreign_cert_file: str  # a client certificate (and its key) from the CA nobody trusts
    foreign_key_file: str
    dir: Path

    def server_context(
        self, *, cert: str = "server", client_cert: str = "none", max_version: ssl.TLSVersion | None = None
    ) -> ssl.SSLContext:
        """A server context; ``client_cert``: ``none``, ``optional`` or ``required`` (mutual TLS)."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        (self.named if cert == "named" else self.server).configure_cert(ctx)
        if client_cert != "none":
            self.ca.configure_trust(ctx)
            ctx.verify_mode = ssl.CERT_REQUIRED if client_cert == "required" else ssl.CERT_OPTIONAL
        if max_version is not None:
            ctx.maximum_version = max_version
        return ctx


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    client = ca.issue_cert("sidecar.test")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    other.cert_pem.write_to_path(str(d / "other-ca.pem"))
    client.cert_chain_pems[0].write_to_path(str(d / "client.pem"))
    client.private_key_pem.write_to_path(str(d / "client.key"))
    ca.issue_cert("someone-else.test").private_key_pem.write_to_path(str(d / "other.key"))
    foreign = other.issue_cert("sidecar.test")
    foreign.cert_chain_pems[0].write_to_path(str(d / "foreign.pem"))
    foreign.private_key_pem.write_to_path(str(d / "foreign.key"))
    return Pki(
        ca=ca,
        server=ca.issue_cert(SERVER_NAME, "127.0.0.1"),
        named=ca.issue_cert(SERVER_NAME),
        ca_file=str(d / "ca.pem"),
        other_ca_file=str(d / "other-ca.pem"),
        cert_file=str(d / "client.pem"),
        key_file=str(d / "client.key"),
        other_key_file=str(d / "other.key"),
        foreign_cert_file=str(d / "foreign.pem"),
        foreign_key_file=str(d / "foreign.key"),
        dir=d,
    )


class TlsRawUpstream(RawUpstream):
    """:class:`tests.engine.RawUpstream` behind TLS; also records, per accepted connection, the
    SNI name the client sent and the client certificate it presented."""

    def __init__(self, ctx: ssl.SSLContext, routes: dict[str, Handler] | None = None) -> None:
        super().__init__(routes)
        self.ctx = ctx
        self.sni: list[str | None] = []
        self.peer_certs: list[Any] = []
        ctx.sni_callback = lambda sslobj, name, _ctx: self.sni.append(name)  # type: ignore[assignment,misc]

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def start(self) -> TlsRawUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.ctx)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.peer_certs.append(writer.get_extra_info("peercert"))
        await super()._serve(reader, writer)


StartTlsUpstream = Callable[..., Awaitable[TlsRawUpstream]]


@pytest.fixture
async def tls_upstream() -> AsyncIterator[StartTlsUpstream]:
    """``await tls_upstream(ctx, routes)``: a started :class:`TlsRawUpstream`."""
    started: list[TlsRawUpstream] = []

    async def start(ctx: ssl.SSLContext, routes: dict[str, Handler] | None = None) -> TlsRawUpstream:
        up = await TlsRawUpstream(ctx, routes).start()
        started.append(up)
        return up

    yield start
    for up in started:
        await up.stop()


StartRecording = Callable[[ssl.SSLContext], Awaitable[RecordingUpstream]]


@pytest.fixture
async def tls_recording_upstream() -> AsyncIterator[StartRecording]:
    """``await tls_recording_upstream(ctx)``: :class:`tests.upstream.RecordingUpstream` behind TLS."""
    runners: list[web.AppRunner] = []

    async def start(ctx: ssl.SSLContext) -> RecordingUpstream:
        up = RecordingUpstream()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", up.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx).start()
        up.url = f"https://127.0.0.1:{runner.addresses[0][1]}"
        return up

    yield start
    for runner in runners:
        await runner.cleanup()


class ThreadedTlsUpstream:
    """A TLS upstream on plain blocking sockets, one thread per connection, outside the event loop.

    Unlike an asyncio TLS server, it sends the alert of a failed handshake and closes gently
    (it reads what the client still sends before closing, so no reset destroys the alert), as
    production servers do; with ``gentle=False`` it closes at once, as a plain Python ``ssl``
    server does (a reset then follows the alert when request bytes were unread, and the client's
    kernel may drop the alert before it is read). It answers ``GET`` requests with
    ``{"target", "conn"}``. After the first response on a connection it waits for ``close_now``,
    if set up with ``close_notify``, then sends a TLS close_notify and closes, from its own thread.
    """

    def __init__(self, ctx: ssl.SSLContext, *, close_notify: bool = False, gentle: bool = True) -> None:
        self.ctx = ctx
        self.close_notify = close_notify
        self.gentle = gentle
        self.close_now = threading.Event()
        self.handshake_errors: list[str] = []
        self.received: list[tuple[int, str]] = []  # (connection number, target)
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.close_now.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
        except OSError:
            pass
        self._listener.close()
        for s in list(self._socks):
            try:
                socket.socket.shutdown(s, socket.SHUT_RDWR)  # wakes a blocked read, TLS or not
            except OSError:
                pass
        for t in [self._accepting, *self._threads]:
            t.join(5)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(sock, self.connections), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, sock: socket.socket, number: int) -> None:
        sock.settimeout(10)
        tls = self.ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        self._socks.append(tls)
        try:
            tls.do_handshake()
        except (ssl.SSLError, OSError) as exc:
            self.handshake_errors.append(getattr(exc, "reason", None) or type(exc).__name__)
            if self.gentle:
                _linger_close(tls)
            else:
                tls.close()
            return
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = tls.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                target = head.split(b" ")[1].decode()
                self.received.append((number, target))
                body = b'{"target":"%s","conn":%d}' % (target.encode(), number)
                tls.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(body), body)
                )
                if self.close_notify:
                    self.close_now.wait(10)
                    tls.settimeout(1)
                    tls.unwrap()  # sends close_notify, then waits for the peer's (which may never come)
                    return
        except (ssl.SSLError, OSError):
            return
        finally:
            tls.close()


def _linger_close(tls: ssl.SSLSocket) -> None:
    """Close after a failed handshake: the alert is out; read until the client closes."""
    try:
        tls.shutdown(socket.SHUT_WR)
        while tls.recv(65536):
            pass
    except OSError:
        pass
    finally:
        tls.close()


@pytest.fixture
def threaded_tls_upstream() -> Iterator[Callable[..., ThreadedTlsUpstream]]:
    started: list[ThreadedTlsUpstream] = []

    def start(ctx: ssl.SSLContext, **kw: Any) -> ThreadedTlsUpstream:
        up = ThreadedTlsUpstream(ctx, **kw)
        started.append(up)
        return up

    yield start
    for up in started:
        up.stop()
