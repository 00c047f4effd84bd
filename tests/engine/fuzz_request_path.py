"""Fuzz target for the fast engine's request path: parser, framing checks, queue, forwarding.

Run on demand for minutes (hypothesis; reports the first failing input, shrunk)::

    FUZZ_SECONDS=300 .venv/bin/python tests/engine/fuzz_request_path.py

``tests/engine/test_fast_http11.py`` runs it for a few seconds in the default suite.

Inputs are request streams built from an HTTP/1.1 grammar (methods, targets, versions,
framing headers, chunked bodies, pipelining) and then byte-mutated. The engine runs on its own
event loop in a background thread, in front of a raw upstream that records every complete
request it receives. For each input, an oracle parses the same bytes with llhttp in strict mode
plus the engine's documented refusals (``sidecar/engine/fast.py``) and the properties are:

* never crashes: no error is logged by the engine or the loop, and a well-formed request on a
  fresh connection still gets a 200 afterwards; nothing stays in flight;
* never forwards a request whose framing it did not fully parse: the requests the upstream
  received are a prefix of the oracle's complete, acceptable requests, with the same method,
  target and body bytes, and each arrived with sane framing;
* always answers or closes: a stream the oracle refuses is answered (400/431/501 JSON) and then
  closed, a stream of complete acceptable requests gets one response per request (or a close
  the client asked for), and whatever the proxy sent is a valid sequence of HTTP responses.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `sidecar` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httptools
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from sidecar.app import Sidecar
from sidecar.config import build_config
from sidecar.engine.fast import FastEngine
from tests.engine import RawUpstream

# The compiled engine decodes chunked request bodies itself (whitespace in extensions allowed).
COMPILED = FastEngine.compiled

# -- the oracle -------------------------------------------------------------------------------


@dataclass
class Parsed:
    method: str = ""
    target: bytes = b""
    version: str = ""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    complete: bool = False
    keep_alive: bool = True


@dataclass
class Verdict:
    accepted: list[Parsed]  # complete requests the engine must forward (in order), up to a refusal
    refused: bool  # the stream ends in a refusal (an answer, then a close)
    incomplete: bool  # the stream ends inside a request (the engine may wait for more)
    heads: list[bool]  # per accepted request: is it HEAD (its response has no body)


class _Collector:
    def __init__(self) -> None:
        self.messages: list[Parsed] = []
        self.in_head = False
        self.parser: Any = None

    def on_message_begin(self) -> None:
        self.messages.append(Parsed())
        self.in_head = True

    def on_url(self, url: bytes) -> None:
        self.messages[-1].target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_head:
            self.messages[-1].headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.in_head = False
        m = self.messages[-1]
        m.method = self.parser.get_method().decode("latin-1")
        m.version = self.parser.get_http_version()
        m.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.messages[-1].body += body

    def on_message_complete(self) -> None:
        self.messages[-1].complete = True


# RFC 3986 3.2.2 uri-host and port, as RFC 9112 3.2 wants a Host value.
_HOST = re.compile(rb"(\[[A-Za-z0-9\-._~!$&'()*+,;=:]+\]|(?:[A-Za-z0-9\-._~!$&'()*+,;=]|%[0-9A-Fa-f]{2})*)(:[0-9]*)?")
_ABSOLUTE = re.compile(rb"(?i:https?)://([^/?#]+)([^#]*)")


def forwarded_target(target: bytes) -> bytes | None:
    """The target the engine forwards: origin-form as sent, absolute-form converted to
    origin-form; None for every other form (refused)."""
    if target.startswith(b"/"):
        return target
    m = _ABSOLUTE.fullmatch(target)
    if m is None or not _HOST.fullmatch(m.group(1)):
        return None
    path = m.group(2)
    return path if path.startswith(b"/") else b"/" + path


def _refused(m: Parsed) -> bool:
    """The engine's refusals beyond llhttp's (see the module docstring of sidecar/engine/fast.py)."""
    lows = [(n.lower(), v) for n, v in m.headers]
    te = [v for n, v in lows if n == b"transfer-encoding"]
    conn = {t.strip().lower() for n, v in lows if n == b"connection" for t in v.split(b",")}
    hosts = [v for n, v in lows if n == b"host"]
    if m.version not in ("1.0", "1.1"):
        return True
    if len(hosts) > 1 or (not hosts and m.version == "1.1"):
        return True
    if hosts and not _HOST.fullmatch(hosts[0].rstrip(b" \t")):
        return True
    if te and (m.version == "1.0" or len(te) > 1 or te[0].strip().lower() != b"chunked"):
        return True
    if any(n == b"upgrade" for n, _ in lows) and b"upgrade" in conn:
        return True
    forwarded = forwarded_target(m.target)
    return m.method == "CONNECT" or forwarded is None or _dot_segment(forwarded)


def _dot_segment(target: bytes) -> bool:
    """A ``.`` or ``..`` path segment, plain or percent-encoded: refused (RFC 3986 5.2.4 would
    take the request out of the upstream's path prefix)."""
    path = target.split(b"?", 1)[0]
    return any(seg.lower().replace(b"%2e", b".") in (b".", b"..") for seg in path.split(b"/"))


_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_EXT = rb"(?:[ \t]*;[ \t]*" + _TOKEN + rb"(?:[ \t]*=[ \t]*" + _TOKEN + rb")?)*"
_SIZE_LINE = re.compile(rb"(?<=\n)([0-9A-Fa-f]+)(" + _EXT + rb")[ \t]*(?=\r\n)")


def _without_bws(data: bytes) -> bytes:
    """``data`` with the bad whitespace RFC 9112 7.1.1 allows in chunk-size lines removed: the
    compiled engine accepts it, llhttp (this oracle's parser) does not."""
    return _SIZE_LINE.sub(lambda m: m.group(1) + re.sub(rb"[ \t]", b"", m.group(2)), data)


def oracle(data: bytes) -> Verdict:
    c = _Collector()
    parser = httptools.HttpRequestParser(c)
    c.parser = parser
    error = False
    if COMPILED:
        data = _without_bws(data)
    try:
        parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        pass  # the upgrade / CONNECT message is complete; the engine refuses it (checked below)
    except httptools.HttpParserError:
        error = True
    accepted: list[Parsed] = []
    for m in c.messages:
        if accepted and not accepted[-1].keep_alive:  # the engine closes after that one's answer
            return Verdict(accepted, False, False, [a.method == "HEAD" for a in accepted])
        if m.method and _refused(m):  # a refused head ends the stream, complete or not
            return Verdict(accepted, True, False, [a.method == "HEAD" for a in accepted])
        if not m.complete:
            return Verdict(accepted, error, not error, [a.method == "HEAD" for a in accepted])
        accepted.append(m)
    if accepted and not accepted[-1].keep_alive:
        error = False
    return Verdict(accepted, error, False, [a.method == "HEAD" for a in accepted])


# -- inputs -----------------------------------------------------------------------------------

METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "CONNECT", "TRACE", "PRI", "get", "G=T"]
VERSIONS = ["HTTP/1.1"] * 6 + ["HTTP/1.0"] * 2 + ["HTTP/2.0", "HTTP/1.2", "HTTP/0.9", "HTTP/11", "http/1.1", ""]
TARGETS = st.one_of(
    st.from_regex(r"\A/[a-zA-Z0-9._~%/?=&-]{0,30}\Z"),
    st.sampled_from(["/", "*", "http://h.example/x?y", "h.example:443", "/a b", "/%zz", "/\x7f", "/é", ""]),
)
NAMES = [
    "Host",
    "Content-Length",
    "Transfer-Encoding",
    "Connection",
    "Upgrade",
    "Expect",
    "X-Correlation-ID",
    "X-Forwarded-For",
    "TE",
    "Trailer",
    "Keep-Alive",
    "X-A",
    "x-a",
    "X A",
    "X:A",
    "",
    "Content-Length ",
    "Transfer-Encoding ",
    "\x00",
]
VALUES = {
    "Content-Length": ["0", "1", "3", "5", "10", "-1", "+3", "3 3", "0x3", "99999999999999999999", "", " 3"],
    "Transfer-Encoding": [
        "chunked",
        "CHUNKED",
        "gzip, chunked",
        "chunked, gzip",
        "identity",
        "xchunked",
        " chunked",
        "chunked\x00",
        "",
    ],
    "Connection": [
        "close",
        "keep-alive",
        "upgrade",
        "Upgrade, X-A",
        "X-A",
        "close, keep-alive",
        # naming the framing (or Host) must never unframe the forwarded message
        "content-length",
        "keep-alive, Transfer-Encoding",
        "Host",
        "CONTENT-LENGTH, close",
    ],
    "Upgrade": ["websocket", "h2c"],
    "Host": ["x", "a.example:8080", "[::1]:80", "", "user@evil", "a/b", "a b", "h:8o", "%41", "%4"],
    "Expect": ["100-continue", "nothing"],
}
FRAMING_NOMINATIONS = [
    b"content-length",
    b"Content-Length, keep-alive",
    b"keep-alive, TRANSFER-ENCODING",
    b"Host, Content-Length",
    b"transfer-encoding, content-length",
]
GENERIC_VALUE = st.text(alphabet=st.sampled_from(list("abcXYZ019 ,;=\t\x00\x7f\x80\xff\r\n")), max_size=12)


@st.composite
def chunked_body(draw: st.DrawFn) -> bytes:
    out = b""
    for _ in range(draw(st.integers(0, 3))):
        payload = draw(st.binary(max_size=20))
        size = draw(st.sampled_from(["hex", "hex", "hex", "wrong", "garbage"]))
        size_b = (
            b"%x" % len(payload)
            if size == "hex"
            else (b"%x" % (len(payload) + 1) if size == "wrong" else draw(st.sampled_from([b"zz", b"-1", b"", b"1 1"])))
        )
        ext = draw(st.sampled_from([b"", b"", b";ext=1", b"; bad", b" ; e = v", b";\x01"]))
        end = draw(st.sampled_from([b"\r\n", b"\r\n", b"\r\n", b"\n", b""]))
        out += size_b + ext + b"\r\n" + payload + end
    if draw(st.booleans()):
        out += b"0\r\n" + draw(st.sampled_from([b"", b"", b"X-Trailer: t\r\n"])) + b"\r\n"
    return out


@st.composite
def request(draw: st.DrawFn) -> bytes:
    eol = draw(st.sampled_from([b"\r\n"] * 8 + [b"\n"]))
    method = draw(st.sampled_from(METHODS)).encode()
    target = draw(TARGETS).encode("utf-8")
    version = draw(st.sampled_from(VERSIONS)).encode()
    lines = [method + b" " + target + b" " + version]
    if draw(st.booleans()):
        lines.append(b"Host: x")
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.sampled_from(NAMES))
        values = VALUES.get(name.strip())
        value = draw(st.sampled_from(values)) if values and draw(st.integers(0, 4)) else draw(GENERIC_VALUE)
        lines.append(name.encode("latin-1") + b": " + value.encode("latin-1"))
    if draw(st.integers(0, 5)) == 0:  # often enough to matter: a Connection line naming the framing
        lines.append(b"Connection: " + draw(st.sampled_from(FRAMING_NOMINATIONS)))
    head = eol.join(lines) + eol + eol
    kind = draw(st.sampled_from(["none", "length", "length", "chunked", "chunked", "raw"]))
    if kind == "length":
        body = draw(st.binary(max_size=24))
        head = (
            head[: -len(eol)]
            + b"Content-Length: %d" % draw(st.sampled_from([len(body)] * 3 + [0, len(body) + 2]))
            + eol
            + eol
        )
    elif kind == "chunked":
        head = head[: -len(eol)] + b"Transfer-Encoding: chunked" + eol + eol
        body = draw(chunked_body())
    elif kind == "raw":
        body = draw(st.binary(max_size=16))
    else:
        body = b""
    return head + body


@st.composite
def stream(draw: st.DrawFn) -> bytes:
    data = b"".join(draw(st.lists(request(), min_size=1, max_size=3)))
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):  # byte-level mutations
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "insert", "delete"]))
        b = bytes([draw(st.integers(0, 255))])
        data = (
            data[:i] + b + data[i + 1 :]
            if op == "flip"
            else data[:i] + b + data[i:]
            if op == "insert"
            else data[:i] + data[i + 1 :]
        )
    return data


# -- the target -------------------------------------------------------------------------------


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Target:
    """The fast engine in front of a raw upstream, on a private event loop in a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-proxy", daemon=True)
        self.errors = _Errors()

    def __enter__(self) -> Target:
        for name in ("sidecar", "asyncio"):
            logging.getLogger(name).addHandler(self.errors)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        for name in ("sidecar", "asyncio"):
            logging.getLogger(name).removeHandler(self.errors)

    async def _start(self) -> None:
        self.upstream = await RawUpstream().start()
        cfg = build_config(
            flags={
                "listen": "127.0.0.1:0",
                "admin": "127.0.0.1:0",
                "upstream": self.upstream.url,
                "mode": "dynamo_headers",
                "engine": "fast",
            },
            env={},
            file=None,
        )
        cfg = cfg.model_copy(update={"readiness_check_upstream": False})
        self.sidecar = Sidecar(cfg, registry=CollectorRegistry())
        await self.sidecar.start()
        self.port = self.sidecar.engine.port

    async def _stop(self) -> None:
        await self.sidecar.stop()
        await self.upstream.stop()
        await asyncio.sleep(0.05)  # let closed transports release their sockets before the loop closes


def _talk(port: int, data: bytes, verdict: Verdict) -> tuple[bytes, bool]:
    """Send ``data``; read until the proxy closes, or answered every complete request."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        try:
            sock.sendall(data)
        except OSError:
            pass  # refused and closed while we were still sending
        want = len(verdict.accepted)
        # Wait for quiet instead of for a count: llhttp cannot count responses to HEAD, and a
        # stream that ends inside a request leaves the engine waiting for the rest (a 3 s wait
        # per such input would let one input eat a short run's whole budget).
        heads = any(verdict.heads) or verdict.incomplete
        counter = _ResponseCounter()
        got = b""
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            if not verdict.refused and not heads and counter.complete >= want:
                return got, False
            sock.settimeout(0.3 if heads else max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return got, False
            except ConnectionResetError:
                return got, True
            if not chunk:
                return got, True
            got += chunk
            counter.feed(chunk)
        return got, False
    finally:
        sock.close()


class _ResponseCounter:
    """Counts complete responses in the proxy's output; notes bytes that are not HTTP."""

    def __init__(self) -> None:
        self.complete = 0
        self.parser = httptools.HttpResponseParser(self)
        self.broken = False
        self.interim = False
        self.statuses: list[int] = []

    def feed(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.broken = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        self.interim = status < 200
        if not self.interim:
            self.statuses.append(status)

    def on_message_complete(self) -> None:
        if not self.interim:
            self.complete += 1


def check(target: Target, data: bytes) -> None:
    verdict = oracle(data)
    up = target.upstream
    before = len(up.received)
    got, closed = _talk(target.port, data, verdict)
    deadline = time.monotonic() + 2.0
    while target.sidecar.engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.005)
    assert target.sidecar.engine.in_flight == 0, "a request stayed in flight after its connection closed"
    forwarded = up.received[before:]
    expected = verdict.accepted
    assert len(forwarded) <= len(expected), (forwarded, expected)
    for rec, want in zip(forwarded, expected):
        assert rec.method == want.method
        assert rec.target.encode("latin-1") == forwarded_target(want.target)
        assert rec.body == want.body
        assert not (rec.header("Content-Length") and rec.header("Transfer-Encoding"))
        assert rec.header("Transfer-Encoding") in (None, "chunked")
    if expected and not verdict.heads[0]:
        assert forwarded, "a complete, acceptable first request was not forwarded"
    counter = _ResponseCounter()
    counter.feed(got)
    if not any(verdict.heads):
        assert not counter.broken, f"the proxy sent something that is not HTTP: {got[:200]!r}"
    if verdict.refused:
        assert closed, "a refused stream was not closed"
        assert got.startswith(b"HTTP/1."), f"a refused stream was closed without an answer: {got[:200]!r}"
        if not any(verdict.heads):
            assert counter.statuses[-1] in (400, 431, 501), got[-300:]
    elif not verdict.incomplete and expected:
        answered = got.count(b"HTTP/1.1 2") + got.count(b"HTTP/1.0 2")
        assert answered >= len(expected) or closed, (got[:300], expected)
    assert not target.errors.records, [r.getMessage() for r in target.errors.records]
    probe = socket.create_connection(("127.0.0.1", target.port), timeout=5)
    try:
        probe.sendall(b"GET /probe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := probe.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    finally:
        probe.close()


def fuzz(seconds: float, *, max_cases: int = 0, examples_per_round: int = 50) -> dict[str, int]:
    """Run the properties on generated inputs for about ``seconds``, or until ``max_cases``
    inputs were checked (0: no bound); return counts."""
    stats = {"cases": 0, "rounds": 0}
    with Target() as target:
        end = time.monotonic() + seconds  # after the set-up, which a loaded machine may slow down

        @settings(
            max_examples=examples_per_round,
            deadline=None,
            database=None,
            derandomize=False,
            suppress_health_check=list(HealthCheck),
            print_blob=True,
        )
        @given(stream())
        def prop(data: bytes) -> None:
            if time.monotonic() > end or stats["cases"] == max_cases > 0:
                return  # out of time or done: let the round finish without more work
            stats["cases"] += 1
            check(target, data)

        while time.monotonic() < end and not stats["cases"] == max_cases > 0:
            prop()
            stats["rounds"] += 1
    return stats


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    total = float(os.environ.get("FUZZ_SECONDS", "60"))
    result = fuzz(total)
    print(f"fuzz_request_path: {result['cases']} inputs in {total:.0f}s, no property violated")
