"""Proxy benchmark: the sidecar against nginx and Envoy doing the same header injection.

    python bench/proxy_bench.py [--cases a,b,c,d,e,f,g,h,i,j] [--engines fast,aiohttp] [--baseline DIR] [--rounds 5]
                                [--duration 5] [--warmup 1] [--prefill 1000000] [--store-prefill 100000]
                                [--stream-n 200] [--stream-n-large 1000] [--stream-events 100]
                                [--stream-waves 3] [--stream-gap-ms 20] [--stream-bytes 110]

Run it with the project's interpreter (.venv/bin/python); scripts/install_bench_tools.sh
installs nginx, wrk and Envoy, scripts/install_redis.sh the Redis server of case i. Everything
listens on 127.0.0.1 and every process started here is stopped by its process group on exit,
Ctrl-C included.

Layout on a two-core machine: the proxy under test runs on core 0; the load (wrk, or the stream
driver) and the stand-in for the inference gateway (a fixed-answer nginx, or the paced SSE
upstream) share core 1. Each case starts its contenders side by side and measures them in
interleaved rounds (each round runs every contender once, in rotating order), so slow drifts of a
shared machine weigh on all of them alike; ratios are taken within a round and the median over
rounds is reported.

Cases:
  a  header-64c    POST, 1 KiB JSON body, X-Correlation-ID over 1000 ids, 64 connections
  b  header-1c     the same over one connection: per-request latency, idle polling on and off
  c  nvext         the sidecar in dynamo_nvext (body) mode against its own header mode
  d  sse           GET a 20-event text/event-stream response, 64 connections
  e  sessions      header mode with --prefill live sessions in the session tree against 1000
  f  stream        --stream-n concurrent paced SSE streams (bench/stream_load.py): CPU per
                   event, time to first event, added inter-event jitter
  g  stream-large  the same with --stream-n-large streams
  h  tls           header mode to an https:// upstream (TLS origination), 64 connections: each
                   contender against itself to the plain upstream, and the sidecar against nginx
                   and Envoy doing the same origination
  i  store         the fast engine in header mode with the Redis session store (a local
                   redis-server on the load core) against the memory store, at 64 connections and
                   at 1, every session known: throughput, latency, store round trips and commands
                   per request (the sidecar's counters, Redis's commandstats); then bytes per
                   session in Redis (--store-prefill new sessions between two memory readings)
  j  churn         header mode, 64 connections, every request a new session, the sidecar's tree
                   prefilled to its cap (--prefill) so that each new session evicts one: latency
                   (p99 against nginx's) while the tree turns over, garbage collection included

Every run writes bench/results/<date>-proxy_bench-<commit>.md (the tables, the targets and their
verdicts, the machine facts) and a .json of the same name with every round's numbers
(bench/record.py).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import resource
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import record
import store_probe

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

PROXY_CPU = 0
LOAD_CPU = 1
HOST = "127.0.0.1"
ENGINES = ("fast", "aiohttp")
BASELINE = "baseline"  # the fast engine of another checkout (--baseline): before/after in one run
CHAT_PATH = "/v1/chat/completions"
SSE_PATH = "/v1/sse"
STREAM_PATH = "/v1/stream"
SSE_EVENTS = 20
MEASURED_IDS = 1000
PREFILL_CONNECTIONS = 256
START_TIMEOUT = 20.0
STOP_GRACE = 5.0
STREAM_THREAD = "sidecar-streams"  # the name of the fast engine's stream thread (sidecar/engine/_direct_reads.pyx)
IDLE_POLL_ON_US = 200  # the fast engine's idle polling window when it is explicitly on
NOFILE = 65536  # two sockets per stream in the proxy, one in the driver, one in the upstream

SESSION_HEADER = "X-Correlation-ID"
SEEN_SESSION = "X-Seen-Session-ID"
SEEN_LENGTH = "X-Seen-Content-Length"
SEEN_TLS = "X-Seen-TLS"  # the upstream's "$ssl_protocol $ssl_cipher" (case h)
# The name in the upstream's certificate: every contender sends it as SNI and checks it.
TLS_NAME = "upstream.bench"

# Targets; verdicts are computed in targets().
TARGET_HEADER_VS_ENVOY = 1.5
TARGET_REQ_PER_CPU_VS_NGINX = 0.75
TARGET_P50_VS_NGINX = 1.1
TARGET_NVEXT_VS_HEADER = 0.7
TARGET_SESSIONS_VS_1K = 0.9
TARGET_STREAM_CPU_VS_NGINX = 1.0
TARGET_STREAM_CPU_VS_ENVOY = 0.6
TARGET_TTFT_P50_OVER_NGINX_MS = 0.1
TARGET_TTFT_P99_VS_NGINX = 1.1
TARGET_GAP_P99_OVER_NGINX_MS = 1.0
# A stream run whose load process (upstream + driver) wanted the load core this much of the time
# (running or waiting for it), or whose upstream sent its events this late (p99), measured the
# load side's delays as much as the proxy's: its latency figures do not count towards a verdict.
LOAD_SATURATED = 0.9
LOAD_LATE_MS = 1.0
# A contender that waited this share of a stream run for its core shared it with other processes.
PROXY_WAIT_NOTE = 0.05
# Store case (i): Redis against the memory store.
TARGET_STORE_RPS_VS_MEMORY = 0.8
TARGET_STORE_P50_OVER_MEMORY_MS = 0.05
TARGET_STORE_ROUND_TRIPS_PER_REQUEST = 0.2
TARGET_STORE_BYTES_PER_SESSION = 400
STORE_LOADS = (64, 1)  # the store case's two loads (wrk connections), each measured every round
STORE_PREFIX = "sidecar:"  # the sidecar's default state.key_prefix
# Before a memory reading: the writes behind of what came before (new sessions within a tick,
# turn counts and holders within the 1 s lazy flush) have reached the store.
STORE_SETTLE_SECONDS = 2.5
STORE_SAMPLE_KEYS = 200  # session hashes whose MEMORY USAGE is read
STORE_WARMUPS = 3  # warm-up runs at most, until every measured session is known


class BenchError(Exception):
    """A condition that stops the benchmark, with a message for the person running it."""


# ---------------------------------------------------------------------------------------------
# Tools and processes


@dataclass(frozen=True)
class Tools:
    nginx: str
    wrk: str
    taskset: str
    envoy: str = ""  # "" when no case of the run has an Envoy contender
    redis_server: str = ""  # "" when the run has no store case (i)


ENVOY_CASES = "abdfghj"  # cases with an Envoy contender
STORE_CASES = "i"  # cases that run a Redis server


def find_tools(tools_dir: Path, cases: Sequence[str] = tuple(ENVOY_CASES + STORE_CASES)) -> Tools:
    """The tools the given cases need (Envoy only for cases with an Envoy contender, redis-server
    only for the store case); BenchError naming the missing ones and how to install them."""
    envoy = tools_dir / "bench" / "bin" / "envoy"
    found = {
        "nginx": shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin"),
        "wrk": shutil.which("wrk"),
        "taskset": shutil.which("taskset"),
    }
    if any(c in ENVOY_CASES for c in cases):
        found["envoy"] = str(envoy) if os.access(envoy, os.X_OK) else None
    if any(c in STORE_CASES for c in cases):
        found["redis_server"] = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/sbin:/sbin")
    missing = [name.replace("_", "-") for name, path in found.items() if path is None]
    if missing:
        raise BenchError(
            f"missing benchmark tools: {', '.join(missing)} (envoy is looked for at {envoy}).\n"
            f"Install them with scripts/install_bench_tools.sh (run as root; it puts Envoy in "
            f"$SIDECAR_TOOLS_DIR/bench, default .tools/bench) and, for the store case, "
            f"scripts/install_redis.sh."
        )
    if (os.cpu_count() or 1) < 2:
        raise BenchError("needs two CPU cores: one for the proxy, one for the load and the upstream")
    return Tools(**found)  # type: ignore[arg-type]


def tool_versions(tools: Tools) -> dict[str, str]:
    def probe(argv: list[str], pattern: str = r".+") -> str:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        match = re.search(pattern, out.stdout + out.stderr)
        return match.group(match.re.groups).strip() if match else "unknown"

    versions = {
        "nginx": probe([tools.nginx, "-v"], r"nginx/(\S+)"),
        "wrk": probe([tools.wrk, "-v"], r"wrk (\S+)"),
    }
    if tools.envoy:
        versions["envoy"] = probe([tools.envoy, "--version"], r"[0-9a-f]{40}/([^/ \n]+)")
    if tools.redis_server:
        versions["redis-server"] = probe([tools.redis_server, "--version"], r"v=(\S+)")
    versions["sidecar"] = probe([sys.executable, "-m", "sidecar", "--version"], r"sidecar (\S+)")
    return versions


def raise_file_limit() -> None:
    """Let this process and its children (proxies, load) hold a few thousand sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = NOFILE if hard == resource.RLIM_INFINITY else min(NOFILE, hard)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


class Processes:
    """Every long-running process the benchmark starts: each leads its own process group, pinned
    to one core with taskset, and is stopped by that group (TERM, then KILL after a grace)."""

    def __init__(self, tools: Tools, log_dir: Path) -> None:
        self._tools = tools
        self._log_dir = log_dir
        self._running: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: Sequence[str], cpu: int) -> subprocess.Popen[bytes]:
        with open(self.log_path(name), "wb") as log:
            proc = subprocess.Popen(
                [self._tools.taskset, "-c", str(cpu), *argv],
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._running.append(proc)
        return proc

    def log_path(self, name: str) -> Path:
        return self._log_dir / f"{name}.log"

    def log_tail(self, name: str, lines: int = 3) -> str:
        try:
            text = self.log_path(name).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "; ".join(line.strip() for line in text[-lines:])

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            # Killed while the leader is still unreaped, so the group id cannot have been reused.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc in self._running:
            self._running.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self._running)):
            self.stop(proc)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (the sockets stay bound until all are picked: two picks one
    after the other can return the same port)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def make_pki(directory: Path) -> None:
    """A CA made for this run (ca.pem) and the upstream's certificate for TLS_NAME signed by it
    (server.pem, server.key): trustme, from the test extra (`pip install -e '.[test]'`)."""
    try:
        import trustme
    except ImportError as exc:
        raise BenchError("the TLS case needs trustme: .venv/bin/pip install -e '.[test]'") from exc
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    cert = ca.issue_cert(TLS_NAME)
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    cert.private_key_pem.write_to_path(str(directory / "server.key"))
    with open(directory / "server.pem", "wb") as f:
        for pem in cert.cert_chain_pems:
            f.write(pem.bytes())


def render(template: str, prefix: Path, **values: int) -> str:
    text = (BENCH / template).read_text()
    user = "user root;" if os.geteuid() == 0 else ""
    text = text.replace("@USER@", user).replace("@PREFIX@", str(prefix))
    for key, value in values.items():
        text = text.replace(f"@{key.upper()}@", str(value))
    if leftover := re.findall(r"@[A-Z_]+@", text):
        raise BenchError(f"{template}: unfilled placeholders {leftover}")
    return text


def _group_stats(pgid: int) -> list[tuple[int, list[str]]]:
    """(pid, /proc/<pid>/stat fields after the command name) of every process in group ``pgid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended meanwhile
        if int(fields[2]) == pgid:
            found.append((int(stat.parent.name), fields))
    return found


def group_cpu_seconds(pgid: int) -> float:
    """CPU time (user + system) used so far by the processes of one process group: the
    contender's own consumption, whatever else the shared machine runs on its core."""
    ticks = sum(int(fields[11]) + int(fields[12]) for _, fields in _group_stats(pgid))
    return ticks / os.sysconf("SC_CLK_TCK")


def group_pids(pgid: int) -> list[int]:
    return [pid for pid, _ in _group_stats(pgid)]


def rss_mib(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        match = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
        if match:
            return int(match.group(1)) / 1024
    return None


# ---------------------------------------------------------------------------------------------
# Contenders


@dataclass(frozen=True)
class Spec:
    """One contender in one case."""

    label: str
    kind: str  # sidecar | nginx | envoy | direct (the stream driver talks to the upstream itself)
    engine: str | None = None
    mode: str = "dynamo_headers"
    prefill: int = 0
    baseline_of: str | None = None  # group whose subject is compared with this one (c, e)
    subject_of: str | None = None
    idle_poll_us: int | None = None  # the sidecar's idle_poll_us setting; None: its default
    tls: bool = False  # to the upstream's https:// port (case h)
    store: bool = False  # state.url to the case's Redis server (case i); else the memory store
    accounting: bool = True  # usage.accounting (off: what reading prompt-cache usage costs, cases a and f)


@dataclass
class Contender:
    spec: Spec
    port: int
    proc: subprocess.Popen[bytes] | None  # None for `direct`
    log_name: str
    admin_port: int | None = None
    upstream_tls: str = ""  # what the upstream saw: "<protocol> <cipher>" over https, "" over http

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None


def http_request(
    port: int,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    timeout: float = 5.0,
    ca_file: Path | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One request; with ``ca_file``, over TLS (the certificate checked against that CA)."""
    if ca_file is None:
        conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    else:
        ctx = ssl.create_default_context(cafile=str(ca_file))
        ctx.check_hostname = False  # it names TLS_NAME, not the address dialled
        conn = http.client.HTTPSConnection(HOST, port, timeout=timeout, context=ctx)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def verify(contender: Contender, sse: bool) -> None:
    """One request through the contender: it must answer 200 and the upstream must have seen
    the session header (header mode) or a rewritten body (dynamo_nvext), over TLS exactly when
    the contender is to the https:// port."""
    session = "verify-0001"
    body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, headers, _ = http_request(
        contender.port, "POST", CHAT_PATH, {SESSION_HEADER: session, "Content-Type": "application/json"}, body
    )
    if status != 200:
        raise BenchError(f"POST {CHAT_PATH} answered {status}")
    if contender.spec.mode == "dynamo_nvext":
        seen = int(headers.get(SEEN_LENGTH.lower(), "0") or 0)
        if seen <= len(body):
            raise BenchError(f"dynamo_nvext did not rewrite the body (upstream saw {seen} bytes)")
    elif headers.get(SEEN_SESSION.lower()) != session:
        raise BenchError(
            f"upstream saw X-Dynamo-Session-ID {headers.get(SEEN_SESSION.lower())!r}, expected {session!r}"
        )
    contender.upstream_tls = headers.get(SEEN_TLS.lower(), "").strip()
    if bool(contender.upstream_tls) != contender.spec.tls:
        raise BenchError(
            f"the upstream saw TLS {contender.upstream_tls!r} from a contender "
            f"{'to https' if contender.spec.tls else 'to http'}"
        )
    if sse:
        status, headers, payload = http_request(contender.port, "GET", SSE_PATH, {SESSION_HEADER: session})
        events = payload.count(b"data: ")
        if (
            status != 200
            or not headers.get("content-type", "").startswith("text/event-stream")
            or events != SSE_EVENTS + 1
        ):
            raise BenchError(
                f"GET {SSE_PATH}: status {status}, {events} events, content-type {headers.get('content-type')!r}"
            )


def verify_stream(contender: Contender) -> None:
    """A short paced stream through the contender: 200, text/event-stream, every event, and
    (through a proxy) the session header injected."""
    session = "verify-0001"
    status, headers, payload = http_request(
        contender.port, "GET", f"{STREAM_PATH}?events=3&gap_us=1000", {SESSION_HEADER: session}
    )
    events = payload.count(b"data: ")
    if status != 200 or not headers.get("content-type", "").startswith("text/event-stream") or events != 3:
        raise BenchError(
            f"GET {STREAM_PATH}: status {status}, {events} of 3 events, content-type {headers.get('content-type')!r}"
        )
    if contender.spec.kind != "direct" and headers.get(SEEN_SESSION.lower()) != session:
        raise BenchError(
            f"upstream saw X-Dynamo-Session-ID {headers.get(SEEN_SESSION.lower())!r}, expected {session!r}"
        )


def wait_until(ready: Callable[[], None], proc: subprocess.Popen[bytes] | None, timeout: float = START_TIMEOUT) -> None:
    """Poll ``ready()`` until it returns without raising; fail if the process exits first."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BenchError(f"exited with status {proc.returncode}")
        try:
            ready()
            return
        except (OSError, http.client.HTTPException, ValueError, BenchError) as exc:
            last = exc
        time.sleep(0.2)
    raise BenchError(f"not ready after {timeout:.0f} s ({last})")


class StreamLoad:
    """The load process of the streaming cases (bench/stream_load.py): the paced upstream and
    the stream driver, on the load core, driven over a control socket."""

    def __init__(self, procs: Processes) -> None:
        self.upstream_port, self.control_port = free_ports(2)
        self.proc = procs.start(
            "stream-load",
            [
                sys.executable,
                str(BENCH / "stream_load.py"),
                "--upstream-port",
                str(self.upstream_port),
                "--control-port",
                str(self.control_port),
            ],
            LOAD_CPU,
        )
        try:
            wait_until(self.ping, self.proc)
        except BenchError as exc:
            raise BenchError(f"the stream load process did not start: {exc}: {procs.log_tail('stream-load')}") from exc

    def ping(self) -> None:
        if not self.call({"ping": True}, 5).get("ok"):
            raise BenchError("the stream load process answered the ping wrongly")

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        try:
            with socket.create_connection((HOST, self.control_port), timeout=timeout) as sock:
                sock.sendall(json.dumps(request).encode() + b"\n")
                with sock.makefile("rb") as reply:
                    line = reply.readline()
        except OSError as exc:
            raise BenchError(f"the stream load process did not answer: {exc}") from exc
        if not line:
            raise BenchError("the stream load process closed the control connection")
        answer: dict[str, Any] = json.loads(line)
        return answer


class Lab:
    """The running upstreams plus the means to start contenders in front of them."""

    def __init__(self, tools: Tools, procs: Processes, workdir: Path) -> None:
        self.tools = tools
        self.procs = procs
        self.workdir = workdir
        self.upstream_port = 0
        self.tls_port = 0  # the same upstream's https:// port
        self.pki = workdir / "pki"
        self.store: Store | None = None  # the store case's Redis server, while that case runs
        self._stream: StreamLoad | None = None
        self._count = 0

    def _prefix(self, name: str) -> Path:
        prefix = self.workdir / name
        for sub in ("", "client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (prefix / sub).mkdir(parents=True, exist_ok=True)
        return prefix

    def _nginx(self, name: str, template: str, port: int, cpu: int, **values: int) -> subprocess.Popen[bytes]:
        prefix = self._prefix(name)
        (prefix / "nginx.conf").write_text(render(template, prefix, listen_port=port, **values))
        return self.procs.start(
            name,
            [self.tools.nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "error.log")],
            cpu,
        )

    def start_upstream(self) -> None:
        port, tls_port = free_ports(2)
        prefix = self._prefix("upstream")
        make_pki(self.pki)
        for name in ("server.pem", "server.key"):
            shutil.copy(self.pki / name, prefix / name)
        chunk = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "model": "bench"}
        events = "".join(
            f"data: {json.dumps({**chunk, 'choices': [{'index': 0, 'delta': {'content': f'token{i} '}}]})}\n\n"
            for i in range(SSE_EVENTS)
        )
        (prefix / "events").write_text(events + "data: [DONE]\n\n")
        proc = self._nginx("upstream", "nginx/upstream.conf", port, LOAD_CPU, tls_port=tls_port)

        def ready() -> None:
            for p, tls in ((port, None), (tls_port, self.pki / "ca.pem")):
                status, headers, _ = http_request(
                    p, "POST", CHAT_PATH, {"X-Dynamo-Session-ID": "probe"}, b"{}", ca_file=tls
                )
                if status != 200 or headers.get(SEEN_SESSION.lower()) != "probe":
                    raise BenchError(f"upstream answered {status} on {'https' if tls else 'http'}")

        try:
            wait_until(ready, proc)
        except BenchError as exc:
            raise BenchError(f"the nginx upstream did not start: {exc}: {self.procs.log_tail('upstream')}") from exc
        self.upstream_port = port
        self.tls_port = tls_port

    def start_store(self) -> Store:
        """A Redis server for the store case, pinned to the load core beside the upstream and
        wrk; no persistence (nothing is written to disk during a run)."""
        port = free_port()
        directory = self.workdir / "redis"
        directory.mkdir(parents=True, exist_ok=True)
        proc = self.procs.start(
            "redis",
            [
                self.tools.redis_server,
                "--port",
                str(port),
                "--bind",
                HOST,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(directory),
            ],
            LOAD_CPU,
        )
        probe = store_probe.StoreProbe(HOST, port)
        try:
            wait_until(probe.ping, proc)
        except BenchError as exc:
            self.procs.stop(proc)
            raise BenchError(f"redis-server did not start: {exc}: {self.procs.log_tail('redis')}") from exc
        self.store = Store(proc, port, probe, probe.version())
        return self.store

    def stop_store(self) -> None:
        if self.store is not None:
            self.store.probe.close()
            self.procs.stop(self.store.proc)
            self.store = None

    @property
    def stream(self) -> StreamLoad:
        """The streaming cases' load process, started on first use."""
        if self._stream is None:
            self._stream = StreamLoad(self.procs)
        return self._stream

    def start(self, spec: Spec, case: Case, args: argparse.Namespace) -> Contender:
        """Start one contender on the proxy core in front of the case's upstream and check it
        proxies correctly; BenchError (with the reason) if it does not start or misbehaves,
        after stopping it."""
        self._count += 1
        name = f"{self._count:02d}-{re.sub(r'[^a-z0-9]+', '-', spec.label.lower()).strip('-')}"
        upstream_port = self.stream.upstream_port if case.streams else self.tls_port if spec.tls else self.upstream_port
        port, sidecar_admin_port = free_ports(2)
        admin_port = None
        proc: subprocess.Popen[bytes] | None = None
        if spec.tls:
            shutil.copy(self.pki / "ca.pem", self._prefix(name) / "ca.pem")
        if spec.kind == "direct":
            port = upstream_port
        elif spec.kind == "nginx":
            proc = self._nginx(
                name,
                "nginx/proxy_tls.conf" if spec.tls else "nginx/proxy.conf",
                port,
                PROXY_CPU,
                upstream_port=upstream_port,
            )
        elif spec.kind == "envoy":
            prefix = self._prefix(name)
            conf = prefix / "envoy.yaml"
            conf.write_text(
                render(
                    "envoy/envoy_tls.yaml" if spec.tls else "envoy/envoy.yaml",
                    prefix,
                    listen_port=port,
                    upstream_port=upstream_port,
                )
            )
            proc = self.procs.start(
                name,
                [
                    self.tools.envoy,
                    "-c",
                    str(conf),
                    "--concurrency",
                    "1",
                    "--log-level",
                    "warning",
                    "--disable-hot-restart",
                ],
                PROXY_CPU,
            )
        else:
            admin_port = sidecar_admin_port
            prefix = self._prefix(name)
            conf = prefix / "sidecar.yaml"
            config = sidecar_config(spec, case, args)
            if spec.tls:
                config["tls"] = {"ca_file": str(prefix / "ca.pem"), "server_name": TLS_NAME}
            if spec.store:
                if self.store is None:
                    raise BenchError("no Redis server is running for a contender with the Redis store")
                config["state"] = {
                    "url": f"redis://{HOST}:{self.store.port}",
                    "key_prefix": STORE_PREFIX,
                    "required": True,
                }
            conf.write_text(json.dumps(config))  # JSON is YAML
            if spec.engine == BASELINE:
                # -P: the other checkout's sidecar, not the one in the working directory
                python = [str(args.baseline / ".venv" / "bin" / "python"), "-P"]
            else:
                python = [sys.executable]
            proc = self.procs.start(
                name,
                [
                    *python,
                    "-m",
                    "sidecar",
                    "run",
                    "--listen",
                    f"{HOST}:{port}",
                    "--admin",
                    f"{HOST}:{admin_port}",
                    "--upstream",
                    f"{'https' if spec.tls else 'http'}://{HOST}:{upstream_port}",
                    "--mode",
                    spec.mode,
                    # dynamo_nvext: the form whose every turn carries the whole patch, as in earlier results.
                    *(["--mode-opt", "protocol=bind"] if spec.mode == "dynamo_nvext" else []),
                    "--engine",
                    "fast" if spec.engine == BASELINE else str(spec.engine),
                    "--log-level",
                    "warning",
                    "--config",
                    str(conf),
                ],
                PROXY_CPU,
            )
        contender = Contender(spec, port, proc, name, admin_port)
        check = (lambda: verify_stream(contender)) if case.streams else (lambda: verify(contender, case.sse))
        try:
            wait_until(check, proc)
        except BenchError as exc:
            if proc is not None:
                self.procs.stop(proc)
            tail = self.procs.log_tail(name)
            raise BenchError(f"{exc}{': ' + tail if tail else ''}") from exc
        return contender

    def stop(self, contender: Contender) -> None:
        if contender.proc is not None:
            self.procs.stop(contender.proc)

    def live_sessions(self, contender: Contender) -> int | None:
        if contender.admin_port is None:
            return None
        with contextlib.suppress(OSError, http.client.HTTPException):
            _, _, body = http_request(contender.admin_port, "GET", "/metrics", timeout=30)
            match = re.search(rb"^sidecar_live_sessions (\S+)$", body, re.MULTILINE)
            if match:
                return int(float(match.group(1)))
        return None


@dataclass
class Store:
    """The store case's running Redis server."""

    proc: subprocess.Popen[bytes]
    port: int
    probe: store_probe.StoreProbe
    version: str


def sidecar_config(spec: Spec, case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """The sidecar's config file for one contender."""
    # No shutdown delay: there is no load balancer to leave when a case ends.
    config: dict[str, Any] = {"drain_grace_seconds": 1, "shutdown_delay_seconds": 0}
    if case.churn:  # the prefill fills the tree to its cap: then every new session evicts one
        config["sessions"] = {"max_live_sessions": args.prefill, "idle_ttl_seconds": 36000}
    elif case.key in "ei":  # nothing may expire or be evicted during the case (nor in the store)
        prefilled = args.prefill if case.key == "e" else args.store_prefill
        config["sessions"] = {"max_live_sessions": max(2_000_000, 2 * prefilled), "idle_ttl_seconds": 36000}
    if case.streams:
        # One upstream connection per stream, as nginx and Envoy open here.
        config["limits"] = {"max_connections_per_upstream": max(512, 2 * case.streams)}
    if spec.idle_poll_us is not None:
        config["idle_poll_us"] = spec.idle_poll_us
    if not spec.accounting:
        config["usage"] = {"accounting": False}
    return config


# ---------------------------------------------------------------------------------------------
# Load: wrk (cases a to e)


@dataclass
class Run:
    case: str
    contender: str
    round: int
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    seconds: float
    errors: int
    proxy_cpu_share: float  # CPU time of the contender's processes / seconds
    requests_per_cpu_second: float
    load_average: float  # the machine's 1-minute load average at the end of the run
    connections: int = 0
    # Store case (i): the sidecar's counter deltas over the run (store_probe.parse_metrics keys:
    # requests, round_trips, commands, ops:<op>:<outcome>, ...) and the Redis server's CPU time.
    store: dict[str, float] = field(default_factory=dict)


def wrk_argv(
    tools: Tools, url: str, script: str, connections: int, duration: float, script_args: Sequence[str]
) -> list[str]:
    return [
        tools.taskset,
        "-c",
        str(LOAD_CPU),
        tools.wrk,
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(duration))}s",
        "--timeout",
        "5s",
        "--latency",
        "-s",
        str(BENCH / "wrk" / script),
        url,
        "--",
        *script_args,
    ]


def parse_wrk(stdout: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        if line.startswith('{"wrk":'):
            result: dict[str, Any] = json.loads(line)
            return result
    raise BenchError(f"wrk printed no result line:\n{stdout[-2000:]}")


def run_wrk(argv: list[str], timeout: float) -> dict[str, Any]:
    # wrk is started through Popen directly (it is already pinned by argv) so that it too leads
    # its own group and is killed by PID on any exit path.
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return parse_wrk(stdout.decode(errors="replace"))


def measure(
    tools: Tools,
    case: Case,
    contender: Contender,
    round_: int,
    connections: int,
    duration: float,
    store: Store | None = None,
) -> Run:
    """One wrk run against the contender. With ``store`` (case i), also the sidecar's request and
    store counters (admin /metrics) and the Redis server's CPU time, read just before and just
    after the run."""
    assert contender.proc is not None
    script_args = [arg.format(round=round_) for arg in case.script_args]
    argv = wrk_argv(tools, contender.url, case.script, connections, duration, script_args)
    before = sidecar_counters(contender) if store is not None else {}
    calls0 = store_calls(store) if store is not None else {}
    store_cpu0 = group_cpu_seconds(store.proc.pid) if store is not None else 0.0
    cpu0 = group_cpu_seconds(contender.proc.pid)
    result = run_wrk(argv, timeout=duration + 30)
    cpu1 = group_cpu_seconds(contender.proc.pid)
    seconds = result["duration_us"] / 1e6 or 1e-9
    requests = result["requests"]
    cpu = cpu1 - cpu0
    counted: dict[str, float] = {}
    if store is not None:
        store_cpu = group_cpu_seconds(store.proc.pid) - store_cpu0
        calls1 = store_calls(store)
        after = sidecar_counters(contender)
        if before and after:
            counted = store_probe.delta(after, before)
        if calls0 and calls1:
            counted.update(store_probe.delta(calls1, calls0))
        counted["store_cpu_s"] = round(store_cpu, 3)
    return Run(
        case=case.key,
        contender=contender.spec.label,
        round=round_,
        rps=requests / seconds,
        p50_ms=result["p50_us"] / 1000,
        p99_ms=result["p99_us"] / 1000,
        requests=requests,
        seconds=round(seconds, 3),
        errors=sum(result["errors"].values()),
        proxy_cpu_share=round(cpu / seconds, 3),
        requests_per_cpu_second=round(requests / cpu) if cpu else 0.0,
        load_average=os.getloadavg()[0],
        connections=connections,
        store=counted,
    )


def store_calls(store: Store) -> dict[str, float]:
    """The Redis server's command calls so far (store_probe.StoreProbe.command_calls); {} when it
    does not answer. Around a run of the Redis contender they are that contender's: nothing else
    talks to the server then but this harness (two INFO calls per run)."""
    try:
        return store.probe.command_calls()
    except OSError as exc:
        log(f"redis-server did not answer INFO commandstats: {exc}")
        return {}


def sidecar_counters(contender: Contender) -> dict[str, float]:
    """The sidecar's request and store counters now; {} when its admin /metrics does not answer."""
    if contender.admin_port is None:
        return {}
    try:
        return store_probe.counters(HOST, contender.admin_port)
    except (OSError, http.client.HTTPException) as exc:
        log(f"{contender.spec.label}: admin /metrics did not answer: {exc}")
        return {}


def prefill(tools: Tools, contender: Contender, total: int, timeout: float) -> dict[str, Any]:
    """Open `total` sessions through the contender with unique ids (bench/wrk/prefill.lua)."""
    argv = wrk_argv(tools, contender.url, "prefill.lua", PREFILL_CONNECTIONS, timeout, [str(total)])
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # wrk's own -d bounds this loop
            lines.append(line)
            if line.strip() == "prefill-complete":
                proc.send_signal(signal.SIGINT)  # wrk then prints its summary and exits
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result = parse_wrk("".join(lines))
    return {
        "requests": result["requests"],
        "seconds": round(time.monotonic() - t0, 1),
        "errors": sum(result["errors"].values()),
        "completed": any(line.strip() == "prefill-complete" for line in lines),
    }


# ---------------------------------------------------------------------------------------------
# Load: paced streams (cases f, g)


@dataclass
class StreamRun:
    case: str
    contender: str
    round: int
    streams: int
    events_expected: int
    events: int  # events delivered
    errors: int  # streams that failed, ended early or timed out
    seconds: float  # the measured interval: first request to last event
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    ttft_flow_p50_ms: float | None  # of the streams started while the others flowed (waves after the first)
    gap_p50_ms: float | None
    gap_p99_ms: float | None
    jitter_p99_ms: float | None  # gap p99 minus the upstream's pacing
    proxy_cpu_s: float | None  # CPU time of the contender's processes over the interval
    cpu_us_per_event: float | None
    proxy_cpu_share: float | None
    proxy_wait_share: float | None  # time the contender was runnable but waited for its core
    load_cpu_share: float  # the load process's (upstream + driver) CPU time over the interval
    load_busy_share: float  # the same, plus the time it waited for the load core
    upstream_cpu_share: float | None  # the upstream's part of load_cpu_share (the rest: the driver)
    upstream_late_p99_ms: float | None  # how late the upstream itself sent its events
    load_limited: bool  # LOAD_SATURATED or LOAD_LATE_MS reached: the load side was a limit
    load_average: float
    # The sidecar's split (None for the others): its event loop's CPU time and its time runnable
    # but waiting for the core, per stream started; its stream thread's CPU time per event.
    loop_cpu_us_per_stream: float | None = None
    loop_wait_us_per_stream: float | None = None
    relay_cpu_us_per_event: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)  # everything the driver reported


def stream_spec(contender: Contender, streams: int, waves: int, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "port": contender.port,
        "streams": streams,
        "events": args.stream_events,
        "gap_us": round(args.stream_gap_ms * 1000),
        "bytes": args.stream_bytes,
        "waves": waves,
        "cpu_pids": group_pids(contender.proc.pid) if contender.proc else [],
        "timeout": args.stream_timeout,
    }


def measure_stream(lab: Lab, case: Case, contender: Contender, round_: int, args: argparse.Namespace) -> StreamRun:
    waves = args.stream_waves if round_ else 1  # round 0 is the unrecorded warm-up run
    spec = stream_spec(contender, case.streams, waves, args)
    nominal = waves * args.stream_events * args.stream_gap_ms / 1000
    result = lab.stream.call(spec, timeout=2 * args.stream_timeout + 3 * nominal + 60)
    if "fatal" in result:
        result = {
            "events": 0,
            "errors": case.streams,
            "error_reasons": {result["fatal"]: case.streams},
            "seconds": 0.0,
            "load_cpu_s": 0.0,
            "load_wait_s": 0.0,
        }
    seconds = result["seconds"] or 1e-9
    events = result["events"]
    cpu = result.get("proxy_cpu_s")
    wait = result.get("proxy_wait_s")
    gap_p99 = result.get("gap_p99_ms")
    late = result.get("upstream_pacing", {}).get("late_p99_ms")
    load_busy = (result["load_cpu_s"] + result["load_wait_s"]) / seconds
    threads = result.get("proxy_threads", {}) if contender.spec.kind == "sidecar" else {}
    loop, relay = threads.get("main"), threads.get(STREAM_THREAD)
    started = case.streams * waves
    return StreamRun(
        case=case.key,
        contender=contender.spec.label,
        round=round_,
        streams=case.streams,
        events_expected=case.streams * args.stream_events * waves,
        events=events,
        errors=result["errors"],
        seconds=seconds,
        ttft_p50_ms=result.get("ttft_p50_ms"),
        ttft_p99_ms=result.get("ttft_p99_ms"),
        ttft_flow_p50_ms=result.get("ttft_later_p50_ms"),
        gap_p50_ms=result.get("gap_p50_ms"),
        gap_p99_ms=gap_p99,
        jitter_p99_ms=None if gap_p99 is None else round(gap_p99 - args.stream_gap_ms, 4),
        proxy_cpu_s=cpu,
        cpu_us_per_event=cpu * 1e6 / events if cpu is not None and events else None,
        proxy_cpu_share=None if cpu is None else round(cpu / seconds, 3),
        proxy_wait_share=None if wait is None else round(wait / seconds, 3),
        load_cpu_share=round(result["load_cpu_s"] / seconds, 3),
        load_busy_share=round(load_busy, 3),
        upstream_cpu_share=None
        if "cpu_s" not in result.get("upstream_pacing", {})
        else round(result["upstream_pacing"]["cpu_s"] / seconds, 3),
        upstream_late_p99_ms=late,
        load_limited=load_busy >= LOAD_SATURATED or (late or 0) > LOAD_LATE_MS,
        load_average=os.getloadavg()[0],
        loop_cpu_us_per_stream=loop["cpu_s"] * 1e6 / started if loop else None,
        loop_wait_us_per_stream=loop["wait_s"] * 1e6 / started if loop else None,
        relay_cpu_us_per_event=relay["cpu_s"] * 1e6 / events if relay and events else None,
        detail=result,
    )


# ---------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    key: str
    name: str
    title: str
    connections: int = 0  # wrk connections (cases a to e)
    script_args: tuple[str, ...] = ()  # "{round}" in one is the run's round (0: warm-up)
    script: str = "post.lua"  # the wrk script (bench/wrk/)
    sse: bool = False
    streams: int = 0  # concurrent paced streams (cases f, g); 0: a wrk case
    tls: bool = False  # contenders to the upstream's https:// port, each against itself to the plain one
    loads: tuple[int, ...] = ()  # wrk connections of each run in a round; () : (connections,)
    store: bool = False  # a Redis server runs for the case (i), its counters and memory are read
    churn: bool = False  # every request a new session, the sidecar's tree full (prefilled to its cap)

    @property
    def connection_counts(self) -> tuple[int, ...]:
        return self.loads or (self.connections,)


def baseline_commit(checkout: Path) -> str:
    """The commit a --baseline checkout is at (``-dirty`` with uncommitted changes)."""

    def git(*argv: str) -> str:
        done = subprocess.run(["git", "-C", str(checkout), *argv], capture_output=True, text=True, check=False)
        return done.stdout.strip()

    return (git("rev-parse", "--short", "HEAD") or "unknown") + (
        "-dirty" if git("status", "--porcelain", "-uno") else ""
    )


def sidecar(engine: str) -> str:
    return f"sidecar({engine})"


POLL_ON = f"{sidecar('fast')} idle poll on"
PLAIN = "to http://"  # case h: the contender to the upstream's plain port
POLL_OFF = f"{sidecar('fast')} idle poll off"
ACCOUNTING_OFF = f"{sidecar('fast')} accounting off"  # cases a and f: usage.accounting false
STORE_MEMORY = f"{sidecar('fast')} memory"  # case i: state.url memory:// (the default)
STORE_REDIS = f"{sidecar('fast')} redis"  # case i: state.url redis://


def human(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


POST_ARGS = (str(MEASURED_IDS), "POST", CHAT_PATH, "1024")
CASE_NAMES = {
    "a": "header-64c",
    "b": "header-1c",
    "c": "nvext",
    "d": "sse",
    "e": "sessions",
    "f": "stream",
    "g": "stream-large",
    "h": "tls",
    "i": "store",
    "j": "churn",
}


def make_cases(args: argparse.Namespace | None) -> dict[str, Case]:
    n = args.stream_n if args else 200
    large = args.stream_n_large if args else 1000
    paced = (
        f"{args.stream_events if args else 100} events {args.stream_gap_ms if args else 20:g} ms apart, "
        f"{args.stream_bytes if args else 110} B each"
    )
    return {
        "a": Case("a", "header-64c", "header mode, 64 connections", 64, POST_ARGS),
        "b": Case("b", "header-1c", "header mode, 1 connection", 1, POST_ARGS),
        "c": Case("c", "nvext", "dynamo_nvext body mode, 64 connections", 64, POST_ARGS),
        "d": Case(
            "d",
            "sse",
            f"SSE response ({SSE_EVENTS} events), 64 connections",
            64,
            (str(MEASURED_IDS), "GET", SSE_PATH),
            sse=True,
        ),
        "e": Case("e", "sessions", "header mode, prefilled session tree, 64 connections", 64, POST_ARGS),
        "f": Case("f", "stream", f"{n} paced SSE streams ({paced})", streams=n),
        "g": Case("g", "stream-large", f"{large} paced SSE streams ({paced})", streams=large),
        "h": Case(
            "h", "tls", "header mode to an https:// upstream (TLS origination), 64 connections", 64, POST_ARGS, tls=True
        ),
        "i": Case(
            "i",
            "store",
            "header mode with the Redis session store against the memory store, "
            f"{' and '.join(map(str, STORE_LOADS))} connections",
            STORE_LOADS[0],
            POST_ARGS,
            loads=STORE_LOADS,
            store=True,
        ),
        "j": Case(
            "j",
            "churn",
            "header mode, every request a new session, the sidecar's session tree full (prefilled to its "
            "cap: each new session evicts the least recently active), 64 connections",
            64,
            # New sessions only, ids of each run's own; a total the run never reaches.
            (str(10**12), CHAT_PATH, "j{round:03d}"),
            script="prefill.lua",
            churn=True,
        ),
    }


def specs_for(case: Case, engines: Sequence[str], prefill_n: int) -> list[Spec]:
    if case.store:  # the fast engine, as deployed, whatever --engines says
        return [
            Spec(STORE_MEMORY, "sidecar", "fast", baseline_of="fast"),
            Spec(STORE_REDIS, "sidecar", "fast", subject_of="fast", store=True),
        ]
    if case.key == "c":
        return [
            spec
            for e in engines
            for spec in (
                Spec(f"{sidecar(e)} headers", "sidecar", e, baseline_of=e),
                Spec(f"{sidecar(e)} nvext", "sidecar", e, mode="dynamo_nvext", subject_of=e),
            )
        ]
    if case.key == "e":
        return [
            spec
            for e in engines
            for spec in (
                Spec(f"{sidecar(e)} 1k sessions", "sidecar", e, baseline_of=e),
                Spec(f"{sidecar(e)} {human(prefill_n)} sessions", "sidecar", e, prefill=prefill_n, subject_of=e),
            )
        ]
    peers = [Spec("nginx", "nginx"), Spec("envoy", "envoy")]
    if case.churn:
        return [
            *(Spec(f"{sidecar(e)} {human(prefill_n)} full", "sidecar", e, prefill=prefill_n) for e in engines),
            *peers,
        ]
    if case.tls:
        # Every contender twice: to the https:// port (the subject, named as in the other cases, so
        # that x Envoy / x nginx compare TLS with TLS) and to the plain port (its own baseline).
        kinds = [(sidecar(e), "sidecar", e) for e in engines] + [("nginx", "nginx", None), ("envoy", "envoy", None)]
        return [
            spec
            for label, kind, engine in kinds
            for spec in (
                Spec(f"{label} {PLAIN}", kind, engine, baseline_of=label),
                Spec(label, kind, engine, subject_of=label, tls=True),
            )
        ]
    if case.key == "b":
        # One connection: the fast engine with idle polling on and off, whatever the default is.
        fast = (
            [
                Spec(POLL_ON, "sidecar", "fast", idle_poll_us=IDLE_POLL_ON_US),
                Spec(POLL_OFF, "sidecar", "fast", idle_poll_us=0),
            ]
            if "fast" in engines
            else []
        )
        return [*fast, *(Spec(sidecar(e), "sidecar", e) for e in engines if e != "fast"), *peers]
    sidecars = [Spec(sidecar(e), "sidecar", e) for e in engines]
    if case.streams:
        # The default configuration, and as a contender of its own idle polling explicitly on.
        fast = (
            [
                Spec(POLL_ON, "sidecar", "fast", idle_poll_us=IDLE_POLL_ON_US),
                Spec(ACCOUNTING_OFF, "sidecar", "fast", accounting=False),
            ]
            if "fast" in engines
            else []
        )
        return [Spec("direct", "direct"), *sidecars, *fast, *peers]
    if case.key == "a" and "fast" in engines:  # what the prompt-cache accounting costs per request
        return [*sidecars, Spec(ACCOUNTING_OFF, "sidecar", "fast", accounting=False), *peers]
    return [*sidecars, *peers]


@dataclass
class CaseResult:
    case: Case
    specs: list[Spec]
    skipped: dict[str, str] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    stream_runs: list[StreamRun] = field(default_factory=list)
    info: dict[str, dict[str, Any]] = field(default_factory=dict)


def log(message: str) -> None:
    print(f"[proxy_bench] {message}", file=sys.stderr, flush=True)


def log_stream_run(run: StreamRun) -> None:
    log(
        f"{run.case} round {run.round}: {run.contender}: {run.events}/{run.events_expected} events, "
        f"errors {run.errors}, CPU {fmt(run.cpu_us_per_event, '.1f')} us/event "
        f"({fmt(run.proxy_cpu_share, '.0%')}), TTFT p50 {fmt(run.ttft_p50_ms, '.3f')} "
        f"p99 {fmt(run.ttft_p99_ms, '.3f')} ms, gap p99 {fmt(run.gap_p99_ms, '.3f')} ms, "
        f"load core {run.load_cpu_share:.0%} (upstream {fmt(run.upstream_cpu_share, '.0%')}, busy "
        f"{run.load_busy_share:.0%}), upstream late p99 "
        f"{fmt(run.upstream_late_p99_ms, '.3f')} ms, proxy waited {fmt(run.proxy_wait_share, '.0%')} for its core"
    )


def run_case(lab: Lab, case: Case, args: argparse.Namespace) -> CaseResult:
    result = CaseResult(case, specs_for(case, args.engines, args.prefill))
    running: list[Contender] = []
    store = lab.start_store() if case.store else None
    if store is not None:
        result.info["store"] = {"version": store.version, "port": store.port, "key_prefix": STORE_PREFIX}
    try:
        for spec in result.specs:
            try:
                running.append(lab.start(spec, case, args))
            except BenchError as exc:
                result.skipped[spec.label] = f"did not start: {exc}"
                log(f"{case.key}: {spec.label}: skipped: {exc}")
        for contender in running:
            if contender.spec.prefill:
                assert contender.proc is not None
                log(f"{case.key}: {contender.spec.label}: prefilling {contender.spec.prefill} sessions")
                info = prefill(lab.tools, contender, contender.spec.prefill, args.prefill_timeout)
                info["live_sessions"] = lab.live_sessions(contender)
                info["rss_mib"] = rss_mib(contender.proc.pid)
                result.info[contender.spec.label] = info
                log(f"{case.key}: {contender.spec.label}: prefill {info}")
        for contender in running:
            if contender.upstream_tls:
                result.info.setdefault(contender.spec.label, {})["upstream_tls"] = contender.upstream_tls
        for contender in running:  # round 0: warm-up, not recorded
            if case.streams:
                measure_stream(lab, case, contender, 0, args)
            elif case.store:
                warm_up_sessions(lab, case, contender, args, result)
            else:
                measure(lab.tools, case, contender, 0, case.connections, args.warmup)
        for round_ in range(1, args.rounds + 1):
            shift = (round_ - 1) % max(1, len(running))
            for connections in case.connection_counts:
                for contender in running[shift:] + running[:shift]:
                    if contender.exited():
                        result.skipped.setdefault(
                            contender.spec.label, f"exited during the case: {lab.procs.log_tail(contender.log_name)}"
                        )
                        continue
                    if case.streams:
                        stream_run = measure_stream(lab, case, contender, round_, args)
                        result.stream_runs.append(stream_run)
                        log_stream_run(stream_run)
                        continue
                    run = measure(lab.tools, case, contender, round_, connections, args.duration, store)
                    result.runs.append(run)
                    log(
                        f"{case.key} round {round_}: {run.contender}"
                        f"{f' {connections}c' if case.loads else ''}: {run.rps:,.0f} req/s, "
                        f"p50 {run.p50_ms:.3f} ms, p99 {run.p99_ms:.3f} ms, errors {run.errors}, "
                        f"proxy CPU {run.proxy_cpu_share:.0%}{store_line(run)}"
                    )
        for contender in running:
            if contender.spec.kind == "sidecar" and contender.proc is not None:
                info = result.info.setdefault(contender.spec.label, {})
                info["rss_mib_end"] = rss_mib(contender.proc.pid)
                info["live_sessions_end"] = lab.live_sessions(contender)
        if store is not None:
            for contender in running:
                if contender.spec.store and not contender.exited():
                    info = result.info.setdefault(contender.spec.label, {})
                    try:
                        info["memory"] = store_memory(lab, store, contender, args)
                    except (OSError, BenchError) as exc:  # the throughput figures still count
                        info["memory_error"] = str(exc)
                        log(f"{case.key}: {contender.spec.label}: no memory reading: {exc}")
    finally:
        for contender in running:
            lab.stop(contender)
        lab.stop_store()
    return result


def store_line(run: Run) -> str:
    """The store counters of a case-i run, for the progress log."""
    c = run.store
    if not c.get("requests"):
        return ""
    return (
        f", store: {c.get('round_trips', 0) / c['requests']:.4f} round trips and "
        f"{c.get('commands', 0) / c['requests']:.4f} commands per request, "
        f"{c.get('ops:load:ok', 0):.0f} loads, Redis CPU {c.get('store_cpu_s', 0) / run.seconds:.0%}"
    )


def warm_up_sessions(lab: Lab, case: Case, contender: Contender, args: argparse.Namespace, result: CaseResult) -> None:
    """The store case's warm-up: each load once, repeated (up to STORE_WARMUPS times) until the
    contender holds every measured session, so that the measured runs see known sessions only (a
    first request of a session, or one the sidecar does not hold, waits for a load from the
    store)."""
    for attempt in range(1, STORE_WARMUPS + 1):
        for connections in case.connection_counts:
            measure(lab.tools, case, contender, 0, connections, args.warmup)
        live = lab.live_sessions(contender) or 0
        if live >= MEASURED_IDS:
            result.info.setdefault(contender.spec.label, {})["warmups"] = attempt
            return
    note = f"after {STORE_WARMUPS} warm-ups it held {live} sessions of the {MEASURED_IDS} measured"
    result.info.setdefault(contender.spec.label, {})["warmup_note"] = note
    log(f"{case.key}: {contender.spec.label}: {note}")


def store_memory(lab: Lab, store: Store, contender: Contender, args: argparse.Namespace) -> dict[str, Any]:
    """Bytes per session in Redis: --store-prefill new sessions through the contender between two
    readings of the store's memory (each after the writes behind settled). The whole store's
    used_memory delta per new session is the figure judged; MEMORY USAGE of a sample of session
    hashes, the live-session sorted set's growth and the growth of the keyspace's hash tables
    show where it goes."""
    probe = store.probe
    time.sleep(STORE_SETTLE_SECONDS)
    before = probe.snapshot(STORE_PREFIX)
    counted0 = sidecar_counters(contender)
    log(f"i: {contender.spec.label}: prefilling {args.store_prefill} sessions for the memory reading")
    fill = prefill(lab.tools, contender, args.store_prefill, args.prefill_timeout)
    counted1 = sidecar_counters(contender)
    made = store_probe.delta(counted1, counted0) if counted0 and counted1 else {}
    # Every new session reaches the store within a flush interval or two; wait for them (bounded),
    # then for a lazy flush (holders, turn counts) and a sweep.
    expected = before["live_members"] + int(made.get("requests", 0))
    deadline = time.monotonic() + 30
    while probe.live_members(STORE_PREFIX) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(STORE_SETTLE_SECONDS)
    after = probe.snapshot(STORE_PREFIX)
    hashes = probe.hash_usage(STORE_PREFIX + "s:00000000-fill-*", STORE_SAMPLE_KEYS)
    settled = sidecar_counters(contender)
    sessions = after["live_members"] - before["live_members"]
    per = (lambda key: (after[key] - before[key]) / sessions) if sessions > 0 else (lambda key: None)
    tables = (
        None
        if sessions <= 0
        else (
            after["hashtable_main"]
            + after["hashtable_expires"]
            - before["hashtable_main"]
            - before["hashtable_expires"]
        )
        / sessions
    )
    info: dict[str, Any] = {
        "prefill": fill,
        "sessions": sessions,
        "expected_sessions": expected - before["live_members"],
        "before": before,
        "after": after,
        "hashes": hashes,
        "bytes_per_session": per("used_memory"),
        "live_member_bytes": per("live_usage"),
        "hashtable_bytes": tables,
        "prefill_counters": made,
        "store_up": settled.get("store_up"),
        "dropped_writes": settled.get("dropped"),
    }
    log(
        f"i: {contender.spec.label}: {sessions} sessions: {fmt(info['bytes_per_session'], ',.0f')} B per "
        f"session (used_memory delta); hash {fmt(hashes.get('mean'), ',.0f')} B, live member "
        f"{fmt(info['live_member_bytes'], ',.0f')} B, hash tables {fmt(tables, ',.0f')} B"
    )
    return info


# ---------------------------------------------------------------------------------------------
# Summary


def median_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def per_round(runs: Sequence[Any], label: str) -> dict[int, Any]:
    return {run.round: run for run in runs if run.contender == label}


def round_ratio(runs: Sequence[Any], num: str, den: str, metric: str = "rps") -> float | None:
    """Median over rounds of num/den, each ratio taken within one round."""
    a, b = per_round(runs, num), per_round(runs, den)
    ratios = [
        getattr(a[r], metric) / getattr(b[r], metric)
        for r in a.keys() & b.keys()
        if getattr(a[r], metric) is not None and getattr(b[r], metric)
    ]
    return median_or_none(ratios)


def round_difference(runs: Sequence[Any], num: str, den: str, metric: str) -> float | None:
    """Median over rounds of num - den, each difference taken within one round."""
    a, b = per_round(runs, num), per_round(runs, den)
    diffs = [
        getattr(a[r], metric) - getattr(b[r], metric)
        for r in a.keys() & b.keys()
        if getattr(a[r], metric) is not None and getattr(b[r], metric) is not None
    ]
    return median_or_none(diffs)


@dataclass
class Row:
    """One contender of a wrk case (a to e), medians over rounds."""

    case: str
    contender: str
    kind: str
    engine: str | None
    reference: str | None = None  # c, e: the label this contender is compared with
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    vs_envoy: float | None = None
    vs_nginx: float | None = None
    case_ratio: float | None = None
    proxy_cpu_share: float | None = None
    requests_per_cpu_second: float | None = None
    cpu_vs_nginx: float | None = None  # requests per CPU-second over nginx's
    errors: int = 0
    note: str = ""


@dataclass
class StreamRow:
    """One contender of a stream case (f, g): medians over rounds, ratios and differences
    taken within rounds."""

    case: str
    contender: str
    kind: str
    engine: str | None
    reference: str | None = None
    streams: int = 0
    events: int = 0
    events_expected: int = 0
    errors: int = 0
    cpu_us_per_event: float | None = None
    vs_nginx: float | None = None  # CPU per event over nginx's
    vs_envoy: float | None = None
    proxy_cpu_share: float | None = None
    proxy_wait_share: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    ttft_flow_p50_ms: float | None = None
    ttft_p50_over_nginx_ms: float | None = None
    ttft_p99_vs_nginx: float | None = None
    gap_p99_ms: float | None = None
    jitter_p99_ms: float | None = None
    gap_p99_over_nginx_ms: float | None = None
    load_cpu_share: float | None = None
    load_busy_share: float | None = None
    upstream_cpu_share: float | None = None
    upstream_late_p99_ms: float | None = None
    load_limited: bool = False  # in most rounds the load side was a limit (StreamRun.load_limited)
    loop_cpu_us_per_stream: float | None = None
    loop_wait_us_per_stream: float | None = None
    relay_cpu_us_per_event: float | None = None
    note: str = ""


def summarize(result: CaseResult) -> list[Row]:
    rows = []
    runs = result.runs
    labels = {run.contender for run in runs}
    for spec in result.specs:
        row = Row(f"{result.case.key} {result.case.name}", spec.label, spec.kind, spec.engine)
        mine = [run for run in runs if run.contender == spec.label]
        if spec.label in result.skipped and not mine:
            row.note = f"skipped: {result.skipped[spec.label]}"
            rows.append(row)
            continue
        row.rps = median_or_none([r.rps for r in mine])
        row.p50_ms = median_or_none([r.p50_ms for r in mine])
        row.p99_ms = median_or_none([r.p99_ms for r in mine])
        row.proxy_cpu_share = median_or_none([r.proxy_cpu_share for r in mine])
        row.requests_per_cpu_second = median_or_none([r.requests_per_cpu_second for r in mine])
        row.errors = sum(r.errors for r in mine)
        if "envoy" in labels and spec.label != "envoy" and not spec.baseline_of:
            row.vs_envoy = round_ratio(runs, spec.label, "envoy")
        if "nginx" in labels and spec.label != "nginx" and not spec.baseline_of:
            row.vs_nginx = round_ratio(runs, spec.label, "nginx")
            row.cpu_vs_nginx = round_ratio(runs, spec.label, "nginx", "requests_per_cpu_second")
            if result.case.key == "b":
                row.case_ratio = round_ratio(runs, spec.label, "nginx", "p50_ms")
            elif result.case.churn:
                row.case_ratio = round_ratio(runs, spec.label, "nginx", "p99_ms")
        if spec.subject_of:
            row.reference = next(s.label for s in result.specs if s.baseline_of == spec.subject_of)
            row.case_ratio = round_ratio(runs, spec.label, row.reference)
        info = result.info.get(spec.label, {})
        if spec.prefill:
            incomplete = "" if info.get("completed") else " (INCOMPLETE: --prefill-timeout reached)"
            row.note = (
                f"prefill{incomplete}: {info.get('live_sessions_end') or info.get('live_sessions')} "
                f"live sessions, {info.get('seconds')} s, RSS {info.get('rss_mib_end') or 0:.0f} MiB"
            )
        elif spec.label in result.skipped:
            row.note = result.skipped[spec.label]
        elif info.get("upstream_tls"):
            row.note = f"to the upstream: {info['upstream_tls']}"
        rows.append(row)
    return rows


def summarize_streams(result: CaseResult) -> list[StreamRow]:
    rows = []
    runs = result.stream_runs
    labels = {run.contender for run in runs}
    for spec in result.specs:
        row = StreamRow(
            f"{result.case.key} {result.case.name}", spec.label, spec.kind, spec.engine, streams=result.case.streams
        )
        mine = [run for run in runs if run.contender == spec.label]
        if spec.label in result.skipped and not mine:
            row.note = f"skipped: {result.skipped[spec.label]}"
            rows.append(row)
            continue
        row.events = sum(r.events for r in mine)
        row.events_expected = sum(r.events_expected for r in mine)
        row.errors = sum(r.errors for r in mine)
        for name in (
            "cpu_us_per_event",
            "proxy_cpu_share",
            "proxy_wait_share",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "ttft_flow_p50_ms",
            "gap_p99_ms",
            "jitter_p99_ms",
            "load_cpu_share",
            "load_busy_share",
            "upstream_cpu_share",
            "upstream_late_p99_ms",
            "loop_cpu_us_per_stream",
            "loop_wait_us_per_stream",
            "relay_cpu_us_per_event",
        ):
            setattr(row, name, median_or_none([getattr(r, name) for r in mine]))
        row.load_limited = sum(r.load_limited for r in mine) * 2 > len(mine)
        if "nginx" in labels and spec.label != "nginx" and spec.kind != "direct":
            row.reference = "nginx"
            row.vs_nginx = round_ratio(runs, spec.label, "nginx", "cpu_us_per_event")
            row.ttft_p50_over_nginx_ms = round_difference(runs, spec.label, "nginx", "ttft_p50_ms")
            row.ttft_p99_vs_nginx = round_ratio(runs, spec.label, "nginx", "ttft_p99_ms")
            row.gap_p99_over_nginx_ms = round_difference(runs, spec.label, "nginx", "gap_p99_ms")
        if "envoy" in labels and spec.label != "envoy" and spec.kind != "direct":
            row.vs_envoy = round_ratio(runs, spec.label, "envoy", "cpu_us_per_event")
        if spec.label in result.skipped:
            row.note = result.skipped[spec.label]
        rows.append(row)
    return rows


@dataclass
class StoreRow:
    """One contender at one load of the store case (i): medians over rounds; the redis row's
    comparisons with the memory row are taken within rounds; per-request figures are totals over
    the measured runs (counter deltas) divided by the proxied requests counted over them."""

    case: str
    connections: int
    contender: str
    store: str  # memory | redis
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    vs_memory: float | None = None  # req/s over the memory store's, same round and load
    p50_over_memory_ms: float | None = None
    p99_over_memory_ms: float | None = None
    proxy_cpu_share: float | None = None
    requests_per_cpu_second: float | None = None
    cpu_vs_memory: float | None = None  # req/CPU-s over the memory store's
    store_cpu_share: float | None = None  # the Redis server's CPU time over the run's wall time
    seconds: float = 0.0  # the measured runs' durations, summed
    requests_counted: int = 0  # sidecar_requests_total deltas, summed over the measured runs
    round_trips_per_request: float | None = None  # the sidecar's own counters
    commands_per_request: float | None = None
    # The Redis server's view (INFO commandstats): SCRIPT EXISTS calls, which redis-py sends as a
    # round trip of its own before every pipeline that runs a script and the sidecar's round-trip
    # counter does not count; every command the server ran per request, scripts' included.
    script_exists: int = 0
    round_trips_with_script_exists: float | None = None
    redis_calls_per_request: float | None = None
    store_cpu_us_per_request: float | None = None
    loads: int = 0  # store loads during the measured runs (0: every session was known)
    flush_ms: float | None = None  # mean time of a flush round trip, as the sidecar timed it
    flushes: int = 0
    sweeps: int = 0
    store_errors: int = 0  # store operations that failed
    errors: int = 0
    note: str = ""


def summarize_store(result: CaseResult) -> list[StoreRow]:
    rows = []
    baseline = next((s.label for s in result.specs if not s.store), None)
    for connections in result.case.connection_counts:
        runs = [run for run in result.runs if run.connections == connections]
        for spec in result.specs:
            row = StoreRow(
                f"{result.case.key} {result.case.name}", connections, spec.label, "redis" if spec.store else "memory"
            )
            mine = [run for run in runs if run.contender == spec.label]
            if not mine:
                row.note = f"skipped: {result.skipped.get(spec.label, 'not measured')}"
                rows.append(row)
                continue
            row.rps = median_or_none([r.rps for r in mine])
            row.p50_ms = median_or_none([r.p50_ms for r in mine])
            row.p99_ms = median_or_none([r.p99_ms for r in mine])
            row.proxy_cpu_share = median_or_none([r.proxy_cpu_share for r in mine])
            row.requests_per_cpu_second = median_or_none([r.requests_per_cpu_second for r in mine])
            row.store_cpu_share = median_or_none(
                [r.store["store_cpu_s"] / r.seconds for r in mine if "store_cpu_s" in r.store]
            )
            row.errors = sum(r.errors for r in mine)
            totals: dict[str, float] = {}
            for r in mine:
                for key, value in r.store.items():
                    totals[key] = totals.get(key, 0.0) + value
            row.seconds = sum(r.seconds for r in mine)
            row.requests_counted = int(totals.get("requests", 0))
            row.script_exists = int(totals.get("redis:script|exists", 0))
            if row.requests_counted:
                n = row.requests_counted
                row.round_trips_per_request = totals.get("round_trips", 0.0) / n
                row.commands_per_request = totals.get("commands", 0.0) / n
                row.round_trips_with_script_exists = (totals.get("round_trips", 0.0) + row.script_exists) / n
                if "redis:all" in totals:
                    row.redis_calls_per_request = totals["redis:all"] / n
                if "store_cpu_s" in totals:
                    row.store_cpu_us_per_request = totals["store_cpu_s"] * 1e6 / n
            row.loads = int(totals.get("ops:load:ok", 0) + totals.get("ops:load:error", 0))
            row.flushes = int(totals.get("ops:flush:ok", 0))
            if totals.get("latency_count:flush"):
                row.flush_ms = totals.get("latency_sum:flush", 0.0) * 1000 / totals["latency_count:flush"]
            row.sweeps = int(totals.get("ops:sweep:ok", 0))
            row.store_errors = int(sum(v for k, v in totals.items() if k.startswith("ops:") and k.endswith(":error")))
            if spec.store and baseline is not None:
                row.vs_memory = round_ratio(runs, spec.label, baseline)
                row.cpu_vs_memory = round_ratio(runs, spec.label, baseline, "requests_per_cpu_second")
                row.p50_over_memory_ms = round_difference(runs, spec.label, baseline, "p50_ms")
                row.p99_over_memory_ms = round_difference(runs, spec.label, baseline, "p99_ms")
            notes = [result.skipped[spec.label]] if spec.label in result.skipped else []
            info = result.info.get(spec.label, {})
            if info.get("warmup_note"):
                notes.append(info["warmup_note"])
            if row.loads:
                notes.append(f"{row.loads} store loads during the measured runs (sessions not held)")
            if row.store_errors:
                notes.append(f"{row.store_errors} store operations failed")
            row.note = "; ".join(notes)
            rows.append(row)
    return rows


@dataclass(frozen=True)
class TargetDef:
    cases: str  # case keys it applies to
    text: str
    attribute: str  # the Row / StreamRow field holding the measured value
    threshold: float
    at_most: bool
    unit: str  # "x": a ratio; "ms": a difference in milliseconds
    reference: str | None  # label whose errors also invalidate the comparison; None: row.reference
    latency: bool = False  # a latency figure: not judged when the load side was the limit
    aim: bool = False  # an aim rather than a commitment; the verdict says so
    fast_only: bool = True  # set for the fast engine: the aiohttp engine's verdict is for reference


TARGETS = [
    TargetDef(
        "a",
        f"header 64c: req/s >= {TARGET_HEADER_VS_ENVOY}x Envoy",
        "vs_envoy",
        TARGET_HEADER_VS_ENVOY,
        False,
        "x",
        "envoy",
    ),
    TargetDef(
        "a",
        f"header 64c: requests per CPU-second >= {TARGET_REQ_PER_CPU_VS_NGINX}x nginx (aim)",
        "cpu_vs_nginx",
        TARGET_REQ_PER_CPU_VS_NGINX,
        False,
        "x",
        "nginx",
        aim=True,
    ),
    TargetDef(
        "b",
        f"header 1c: p50 <= {TARGET_P50_VS_NGINX}x nginx p50",
        "case_ratio",
        TARGET_P50_VS_NGINX,
        True,
        "x",
        "nginx",
    ),
    TargetDef(
        "c",
        f"dynamo_nvext: req/s >= {TARGET_NVEXT_VS_HEADER}x own header mode",
        "case_ratio",
        TARGET_NVEXT_VS_HEADER,
        False,
        "x",
        None,
        fast_only=False,
    ),
    TargetDef(
        "e",
        f"prefilled sessions: req/s >= {TARGET_SESSIONS_VS_1K}x 1k sessions",
        "case_ratio",
        TARGET_SESSIONS_VS_1K,
        False,
        "x",
        None,
        fast_only=False,
    ),
    TargetDef(
        "fg",
        f"CPU per streamed event <= {TARGET_STREAM_CPU_VS_NGINX}x nginx",
        "vs_nginx",
        TARGET_STREAM_CPU_VS_NGINX,
        True,
        "x",
        "nginx",
    ),
    TargetDef(
        "fg",
        f"CPU per streamed event <= {TARGET_STREAM_CPU_VS_ENVOY}x Envoy",
        "vs_envoy",
        TARGET_STREAM_CPU_VS_ENVOY,
        True,
        "x",
        "envoy",
    ),
    TargetDef(
        "fg",
        f"time to first event p50 <= nginx + {TARGET_TTFT_P50_OVER_NGINX_MS} ms",
        "ttft_p50_over_nginx_ms",
        TARGET_TTFT_P50_OVER_NGINX_MS,
        True,
        "ms",
        "nginx",
        latency=True,
    ),
    TargetDef(
        "fg",
        f"time to first event p99 <= {TARGET_TTFT_P99_VS_NGINX}x nginx",
        "ttft_p99_vs_nginx",
        TARGET_TTFT_P99_VS_NGINX,
        True,
        "x",
        "nginx",
        latency=True,
    ),
    TargetDef(
        "fg",
        f"inter-event gap p99 <= nginx + {TARGET_GAP_P99_OVER_NGINX_MS:g} ms",
        "gap_p99_over_nginx_ms",
        TARGET_GAP_P99_OVER_NGINX_MS,
        True,
        "ms",
        "nginx",
        latency=True,
    ),
]


@dataclass
class Target:
    case: str
    text: str
    contender: str
    measured: float | None
    unit: str
    verdict: str


def targets(results: dict[str, CaseResult], rows: Sequence[Row | StreamRow]) -> list[Target]:
    """A verdict per target and sidecar contender: met / not met. Most targets are set for the
    fast engine; there the aiohttp engine's verdicts are marked as reference. A comparison with
    errors on either side, or against an incomplete prefill, is invalid; a latency comparison
    where the load process was the limit is not judged."""
    by = {(row.case.split()[0], row.contender): row for row in rows}
    out = []
    for definition in TARGETS:
        for case in definition.cases:
            if case not in results:
                continue
            result = results[case]
            for spec in result.specs:
                if spec.kind != "sidecar" or (case in "ce" and not spec.subject_of):
                    continue
                row = by.get((case, spec.label))
                value = getattr(row, definition.attribute) if row else None
                reference_label = definition.reference or (row.reference if row else None) or ""
                reference = by.get((case, reference_label))
                errors = (row.errors if row else 0) + (reference.errors if reference else 0)
                limited = [r.contender for r in (row, reference) if r is not None and getattr(r, "load_limited", False)]
                if row is None or value is None:
                    skipped = result.skipped.get(spec.label) or result.skipped.get(reference_label)
                    verdict = f"skipped ({skipped})" if skipped else "not measured"
                elif errors:
                    verdict = f"invalid ({errors} errors)"
                elif case == "e" and not result.info.get(spec.label, {}).get("completed"):
                    live = result.info.get(spec.label, {}).get("live_sessions")
                    verdict = f"invalid (prefill incomplete: {live} live sessions)"
                elif definition.latency and limited:
                    verdict = f"not judged (the load side was a limit in the runs of {', '.join(limited)})"
                else:
                    met = value <= definition.threshold if definition.at_most else value >= definition.threshold
                    verdict = "met" if met else "not met"
                    if definition.fast_only and spec.engine != "fast":
                        verdict += " (reference: the target is set for the fast engine)"
                    elif definition.aim:
                        verdict += " (aim)"
                out.append(Target(case, definition.text, spec.label, value, definition.unit, verdict))
    return sorted(out, key=lambda t: t.case)  # stable: within a case, in TARGETS order


def store_targets(results: dict[str, CaseResult], rows: Sequence[StoreRow]) -> list[Target]:
    """The store case's verdicts: throughput and 1-connection p50 of the Redis store against the
    memory store, round trips per proxied request at each load, bytes per session in Redis. A
    comparison with errors on either side, or with failed store operations, is invalid, as is
    the memory figure after an incomplete prefill or with the store down or writes dropped."""
    if "i" not in results:
        return []
    result = results["i"]
    by = {(row.connections, row.store): row for row in rows if row.case.startswith("i ")}
    wide, one = STORE_LOADS[0], STORE_LOADS[-1]
    out = []

    def judge(
        text: str,
        contender: str,
        value: float | None,
        threshold: float,
        at_most: bool,
        unit: str,
        compared: Sequence[StoreRow | None],
    ) -> None:
        errors = sum(r.errors for r in compared if r is not None)
        store_errors = sum(r.store_errors for r in compared if r is not None)
        if value is None:
            skipped = result.skipped.get(STORE_REDIS) or result.skipped.get(STORE_MEMORY)
            verdict = f"skipped ({skipped})" if skipped else "not measured"
        elif errors:
            verdict = f"invalid ({errors} errors)"
        elif store_errors:
            verdict = f"invalid ({store_errors} store operations failed)"
        else:
            met = value <= threshold if at_most else value >= threshold
            verdict = "met" if met else "not met"
        out.append(Target("i", text, contender, value, unit, verdict))

    redis_wide, memory_wide = by.get((wide, "redis")), by.get((wide, "memory"))
    redis_one, memory_one = by.get((one, "redis")), by.get((one, "memory"))
    judge(
        f"store, {wide}c: req/s with Redis >= {TARGET_STORE_RPS_VS_MEMORY}x the memory store",
        STORE_REDIS,
        redis_wide.vs_memory if redis_wide else None,
        TARGET_STORE_RPS_VS_MEMORY,
        False,
        "x",
        [redis_wide, memory_wide],
    )
    judge(
        f"store, {one}c: p50 of known sessions with Redis <= the memory store's + {TARGET_STORE_P50_OVER_MEMORY_MS} ms",
        STORE_REDIS,
        redis_one.p50_over_memory_ms if redis_one else None,
        TARGET_STORE_P50_OVER_MEMORY_MS,
        True,
        "ms",
        [redis_one, memory_one],
    )
    for row in (redis_wide, redis_one):
        if row is not None:
            judge(
                f"store, {row.connections}c: store round trips per proxied request <= "
                f"{TARGET_STORE_ROUND_TRIPS_PER_REQUEST}",
                STORE_REDIS,
                row.round_trips_per_request,
                TARGET_STORE_ROUND_TRIPS_PER_REQUEST,
                True,
                "/req",
                [row],
            )
    memory = result.info.get(STORE_REDIS, {}).get("memory")
    text = f"store: bytes per session in Redis <= {TARGET_STORE_BYTES_PER_SESSION} (whole-store used_memory delta)"
    if memory is None:
        skipped = result.skipped.get(STORE_REDIS)
        failed = result.info.get(STORE_REDIS, {}).get("memory_error")
        verdict = f"skipped ({skipped})" if skipped else f"not measured ({failed})" if failed else "not measured"
        out.append(Target("i", text, STORE_REDIS, None, "B", verdict))
    else:
        value = memory.get("bytes_per_session")
        if value is not None and not memory["prefill"].get("completed"):
            verdict = f"invalid (prefill incomplete: {memory['sessions']} sessions)"
        elif value is not None and (memory.get("store_up") != 1.0 or memory.get("dropped_writes")):
            verdict = f"invalid (store up: {memory.get('store_up')}, {memory.get('dropped_writes')} writes dropped)"
        elif value is None:
            verdict = "not measured"
        else:
            verdict = "met" if value <= TARGET_STORE_BYTES_PER_SESSION else "not met"
        out.append(Target("i", text, STORE_REDIS, value, "B", verdict))
    return out


def polling_statement(target_list: Sequence[Target]) -> str | None:
    """Which of the fast engine's two 1-connection contenders met the 1-connection target."""
    by = {t.contender: t for t in target_list if t.case == "b"}
    variants = [
        (f"idle polling on (idle_poll_us: {IDLE_POLL_ON_US})", by.get(POLL_ON)),
        ("idle polling off (idle_poll_us: 0)", by.get(POLL_OFF)),
    ]
    if not any(target for _, target in variants):
        return None
    each = "; ".join(f"with {name}: {target.verdict} ({measured_text(target)})" for name, target in variants if target)
    met = [name for name, target in variants if target and target.verdict == "met"]
    return (
        f"1-connection target (p50 <= {TARGET_P50_VS_NGINX}x nginx), fast engine: {each}. "
        f"Met by: {' and '.join(met) if met else 'neither'}."
    )


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def measured_text(target: Target) -> str:
    if target.unit == "ms":
        return fmt(target.measured, "+.3f", " ms")
    if target.unit == "/req":
        return fmt(target.measured, ".4f", " per request")
    if target.unit == "B":
        return fmt(target.measured, ",.0f", " B")
    return fmt(target.measured, ".2f", "x")


cell = record.cell


def request_table(rows: Sequence[Row], args: argparse.Namespace) -> list[str]:
    lines = [
        f"Request cases: {args.rounds} interleaved rounds x {args.duration:g} s per contender (warm-up "
        f"{args.warmup:g} s), wrk -t1, proxy on core {PROXY_CPU}, wrk + nginx upstream on core {LOAD_CPU}.",
        "",
        "| case | contender | req/s | p50 ms | p99 ms | x Envoy | x nginx | case ratio | proxy CPU | req/CPU-s "
        "| req/CPU-s x nginx | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for row in rows:
        if row.rps is None:
            lines.append(f"| {row.case} | {row.contender} | skipped | | | | | | | | | |")
            notes.append(f"- {row.case} / {row.contender}: {cell(row.note)}")
            continue
        lines.append(
            f"| {row.case} | {row.contender} | {fmt(row.rps, ',.0f')} | {fmt(row.p50_ms, '.3f')} | "
            f"{fmt(row.p99_ms, '.3f')} | {fmt(row.vs_envoy, '.2f')} | {fmt(row.vs_nginx, '.2f')} | "
            f"{fmt(row.case_ratio, '.2f')} | {fmt(row.proxy_cpu_share, '.0%')} | "
            f"{fmt(row.requests_per_cpu_second, ',.0f')} | {fmt(row.cpu_vs_nginx, '.2f')} | {row.errors} |"
        )
        if row.note:
            notes.append(f"- {row.case} / {row.contender}: {cell(row.note)}")
    lines += [
        "",
        "Ratios are medians of per-round ratios. case ratio: (b) p50 / nginx p50; (c) req/s / the same "
        "engine in header mode; (e) req/s / the same engine at 1k sessions; (j) p99 / nginx p99 (the "
        "tree's churn, garbage collection included, against a proxy that keeps no sessions); (h) req/s to the https:// "
        f"upstream / the same contender's `{PLAIN}` req/s (in h, x Envoy and x nginx compare TLS "
        "origination with TLS origination). proxy CPU: CPU time the "
        "contender's processes used over the run's wall time (near 100%: the proxy was the limit; well "
        "below: the load side, or other processes sharing the core). req/CPU-s: requests per second "
        "of the contender's own CPU time, which other load on the machine disturbs less. "
        f"{POLL_ON} / {POLL_OFF}: idle_poll_us {IDLE_POLL_ON_US} / 0 set explicitly; {ACCOUNTING_OFF}: "
        "usage.accounting false (no prompt-cache usage read: its cost is the difference); plain "
        "sidecar(fast) runs the default configuration.",
    ]
    return lines + (["", *notes] if notes else [])


def stream_table(rows: Sequence[StreamRow], args: argparse.Namespace) -> list[str]:
    lines = [
        f"Stream cases: {args.rounds} interleaved rounds per contender (plus one warm-up run); each run opens "
        f"N keep-alive connections, runs a warm-up stream on each, then {args.stream_waves} measured streams per "
        f"connection back to back ({args.stream_events} events of {args.stream_bytes} B, "
        f"{args.stream_gap_ms:g} ms apart; the first requests spread evenly over one gap, each later one sent "
        f"as its connection's last stream ends, while the other streams flow). Proxy on core {PROXY_CPU}; paced "
        f"upstream + stream driver (one process) on core {LOAD_CPU}.",
        "",
        "| case | contender | events | errors | proxy CPU | CPU us/event | x nginx | x Envoy | TTFT p50 ms "
        "| TTFT p99 ms | TTFT p99 x nginx | TTFT p50 in flow ms | gap p99 ms | added jitter p99 ms "
        "| load core (upstream) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for row in rows:
        if not row.events_expected:
            lines.append(f"| {row.case} | {row.contender} | skipped | | | | | | | | | | | | |")
            notes.append(f"- {row.case} / {row.contender}: {cell(row.note)}")
            continue
        lines.append(
            f"| {row.case} | {row.contender} | {row.events:,} | {row.errors} | {fmt(row.proxy_cpu_share, '.0%')} | "
            f"{fmt(row.cpu_us_per_event, '.1f')} | {fmt(row.vs_nginx, '.2f')} | {fmt(row.vs_envoy, '.2f')} | "
            f"{fmt(row.ttft_p50_ms, '.3f')} | {fmt(row.ttft_p99_ms, '.3f')} | {fmt(row.ttft_p99_vs_nginx, '.2f')} | "
            f"{fmt(row.ttft_flow_p50_ms, '.3f')} | {fmt(row.gap_p99_ms, '.3f')} | {fmt(row.jitter_p99_ms, '.3f')} | "
            f"{fmt(row.load_cpu_share, '.0%')} ({fmt(row.upstream_cpu_share, '.0%')})"
            f"{' limit' if row.load_limited else ''} |"
        )
        if row.note:
            notes.append(f"- {row.case} / {row.contender}: {cell(row.note)}")
        if row.load_limited:
            notes.append(
                f"- {row.case} / {row.contender}: the load side was a limit in most rounds: load process "
                f"busy {fmt(row.load_busy_share, '.0%')} of the interval (running or waiting for its "
                f"core), upstream events sent up to {fmt(row.upstream_late_p99_ms, '.2f')} ms late (p99)"
            )
        if row.proxy_wait_share is not None and row.proxy_wait_share >= PROXY_WAIT_NOTE:
            notes.append(
                f"- {row.case} / {row.contender}: waited {row.proxy_wait_share:.0%} of the interval for its "
                f"core (other processes on core {PROXY_CPU})"
            )
    lines += [
        "",
        "events: delivered, summed over rounds; errors: streams that failed, ended early or timed out. "
        "proxy CPU: the contender's CPU time over the measured interval (first request to last event); "
        "CPU us/event: that CPU time per delivered event, from the scheduler's per-thread run time of the "
        "contender's processes (/proc/<pid>/task/*/schedstat, the counter behind /proc/<pid>/stat utime + "
        "stime, in ns). TTFT: from the request's last byte written to the first event byte received, on a "
        "warm keep-alive connection; in flow: of the streams after each connection's first, each started as "
        "its connection's last stream ended, while the other streams flowed. gap: time between consecutive "
        "events of one stream as received; added "
        f"jitter = gap p99 - the upstream's {args.stream_gap_ms:g} ms pacing. x nginx / x Envoy and TTFT p99 "
        "x nginx: medians of per-round ratios. load core: CPU time of the load process (upstream + driver) "
        "over the interval, and in brackets the upstream's part of it. limit: in most rounds that process was "
        f"busy (running or waiting for its core) {LOAD_SATURATED:.0%} of the interval or more, or the upstream "
        f"sent its events more than {LOAD_LATE_MS:g} ms late (p99): the latency figures then measure the load "
        "side too and are not judged. "
        "`direct`: the driver against the upstream, no proxy: the floor of TTFT and jitter. "
        f"{POLL_ON}: idle_poll_us {IDLE_POLL_ON_US}; {ACCOUNTING_OFF}: usage.accounting false (no "
        "prompt-cache usage read: its cost is the difference); plain sidecar(fast) runs the default configuration.",
    ]
    return lines + (["", *notes] if notes else [])


def split_table(rows: Sequence[StreamRow]) -> list[str]:
    """The sidecar's CPU per stream case split between its two threads (it explains the time to
    first event: every stream start is the event loop's work, while the stream thread relays the
    other streams' events on the same core)."""
    split = [r for r in rows if r.loop_cpu_us_per_stream is not None]
    if not split:
        return []
    lines = [
        "",
        "Where the sidecar's CPU went:",
        "",
        "| case | contender | event loop CPU us per stream | event loop waiting for the core us per stream "
        "| stream thread CPU us per event |",
        "|---|---|---:|---:|---:|",
    ]
    for r in split:
        lines.append(
            f"| {r.case} | {r.contender} | {fmt(r.loop_cpu_us_per_stream, '.1f')} | "
            f"{fmt(r.loop_wait_us_per_stream, '.1f')} | {fmt(r.relay_cpu_us_per_event, '.1f')} |"
        )
    lines += [
        "",
        "Medians over rounds, from the per-thread schedstat counters. The event loop (the process's main "
        "thread) starts every stream (request head, routing, the upstream request, the response head and "
        "first event, the hand-over to the stream thread) and ends it; per stream started, its CPU time and "
        "its time runnable but waiting for the core, which the stream thread (relaying the other streams' "
        f"events on the same core, `{STREAM_THREAD}`) or other processes held. The stream starts of a wave "
        "arrive together, so this per-stream cost sets the queueing behind the time to first event.",
    ]
    return lines


def growth_table(rows: Sequence[StreamRow]) -> list[str]:
    """CPU per event and latency at the two stream counts, per contender."""
    small = {r.contender: r for r in rows if r.case.startswith("f ")}
    large = {r.contender: r for r in rows if r.case.startswith("g ")}
    both = [label for label in small if label in large and small[label].events and large[label].events]
    if not both:
        return []
    n, big = small[both[0]].streams, large[both[0]].streams
    lines = [
        "",
        f"How the cost grows from {n} to {big} streams:",
        "",
        f"| contender | CPU us/event at {n} | at {big} | growth | TTFT p99 ms at {n} | at {big} "
        f"| gap p99 ms at {n} | at {big} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label in both:
        a, b = small[label], large[label]
        growth = b.cpu_us_per_event / a.cpu_us_per_event if a.cpu_us_per_event and b.cpu_us_per_event else None
        lines.append(
            f"| {label} | {fmt(a.cpu_us_per_event, '.1f')} | {fmt(b.cpu_us_per_event, '.1f')} | "
            f"{fmt(growth, '.2f', 'x')} | {fmt(a.ttft_p99_ms, '.3f')} | {fmt(b.ttft_p99_ms, '.3f')} | "
            f"{fmt(a.gap_p99_ms, '.3f')} | {fmt(b.gap_p99_ms, '.3f')} |"
        )
    return lines


def store_table(rows: Sequence[StoreRow], result: CaseResult, args: argparse.Namespace) -> list[str]:
    store = result.info.get("store", {})
    lines = [
        f"Store case (i): the fast engine in `dynamo_headers` mode with the memory store (`{STORE_MEMORY}`) and "
        f"with the Redis store (`{STORE_REDIS}`: redis-server {store.get('version', '?')} on core {LOAD_CPU} beside "
        f"wrk and the upstream, no persistence), {args.rounds} interleaved rounds x {args.duration:g} s per "
        f"contender and load; every round runs both at {' and at '.join(map(str, STORE_LOADS))} connection(s). "
        f"The warm-up sends every one of the {MEASURED_IDS} session ids first, so the measured requests are of "
        "known sessions.",
        "",
        "| connections | store | req/s | x memory | p50 ms | p50 - memory ms | p99 ms | p99 - memory ms | proxy CPU "
        "| req/CPU-s | req/CPU-s x memory | Redis CPU | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for row in rows:
        if row.rps is None:
            lines.append(f"| {row.connections} | {row.store} | skipped | | | | | | | | | | |")
            notes.append(f"- {row.connections} connections / {row.store}: {cell(row.note)}")
            continue
        lines.append(
            f"| {row.connections} | {row.store} | {fmt(row.rps, ',.0f')} | {fmt(row.vs_memory, '.2f')} | "
            f"{fmt(row.p50_ms, '.3f')} | {fmt(row.p50_over_memory_ms, '+.3f')} | {fmt(row.p99_ms, '.3f')} | "
            f"{fmt(row.p99_over_memory_ms, '+.3f')} | {fmt(row.proxy_cpu_share, '.0%')} | "
            f"{fmt(row.requests_per_cpu_second, ',.0f')} | {fmt(row.cpu_vs_memory, '.2f')} | "
            f"{fmt(row.store_cpu_share, '.0%')} | {row.errors} |"
        )
        if row.note:
            notes.append(f"- {row.connections} connections / {row.store}: {cell(row.note)}")
    lines += [
        "",
        "x memory: the Redis store's req/s (and req/CPU-s) over the memory store's at the same load in the same "
        "round, median over rounds; - memory: the same for the latency percentiles, as differences. Redis CPU: "
        "the Redis server's CPU time over the run's wall time (it shares the load core with wrk and the "
        "upstream: when that core is the limit, the Redis contender's req/s is lowered by it).",
        "",
        "Store traffic of the Redis contender over the measured runs:",
        "",
        "| connections | requests | store round trips/req | commands/req | + SCRIPT EXISTS: round trips/req "
        "| flushes/s | flush ms | sweeps/s | loads | Redis commands/req | Redis CPU us/req |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if row.store != "redis" or row.rps is None:
            continue
        per_second = (lambda n, s=row.seconds: n / s) if row.seconds else (lambda n: None)
        lines.append(
            f"| {row.connections} | {row.requests_counted:,} | {fmt(row.round_trips_per_request, '.4f')} | "
            f"{fmt(row.commands_per_request, '.4f')} | {fmt(row.round_trips_with_script_exists, '.4f')} | "
            f"{fmt(per_second(row.flushes), '.1f')} | {fmt(row.flush_ms, '.1f')} | "
            f"{fmt(per_second(row.sweeps), '.1f')} | {row.loads} | "
            f"{fmt(row.redis_calls_per_request, '.2f')} | {fmt(row.store_cpu_us_per_request, '.1f')} |"
        )
    lines += [
        "",
        "requests: the sidecar's `sidecar_requests_total` over the measured runs (read just before and after each "
        "run, so the idle writes between runs are left out). store round trips/req, commands/req: its "
        "`sidecar_state_round_trips_total` and `sidecar_state_commands_total` over those requests (a script call "
        "counts as one command). + SCRIPT EXISTS: the round trips again with the `SCRIPT EXISTS` calls Redis "
        "counted (redis-py sends one, as a round trip of its own, before every pipeline that runs a script; the "
        "sidecar's counter leaves them out). flushes/s, sweeps/s: its `sidecar_state_ops_total` for those "
        "operations per second of measured run; flush ms: the mean time of a flush as the sidecar timed it "
        "(`sidecar_state_latency_seconds`, event-loop delays included). loads: store loads during the measured runs (requests of sessions "
        "the sidecar did not hold). Redis commands/req: every command the server ran (`INFO commandstats`, the "
        "commands the scripts run included) per request. Redis CPU us/req: the server's CPU time per request.",
    ]
    lines += ["", *notes] if notes else []
    memory = result.info.get(STORE_REDIS, {}).get("memory")
    if memory:
        lines += ["", *memory_table(memory)]
    return lines


def memory_table(memory: dict[str, Any]) -> list[str]:
    before, after, hashes = memory["before"], memory["after"], memory["hashes"]
    n = memory["sessions"]
    fill = memory["prefill"]
    made = memory.get("prefill_counters", {})

    def row(name: str, total: float | None, per: float | None) -> str:
        return f"| {name} | {fmt(total, ',.0f')} | {fmt(per, ',.1f')} |"

    used = after["used_memory"] - before["used_memory"]
    live = after["live_usage"] - before["live_usage"]
    tables = (
        after["hashtable_main"] + after["hashtable_expires"] - before["hashtable_main"] - before["hashtable_expires"]
    )
    hash_mean = hashes.get("mean")
    rest = None if hash_mean is None or n <= 0 else used / n - hash_mean - live / n - tables / n
    incomplete = "" if fill.get("completed") else " (INCOMPLETE: --prefill-timeout reached)"
    lines = [
        f"Bytes per session in Redis: {n:,} new sessions (one request each, {PREFILL_CONNECTIONS} connections, "
        f"{fill.get('seconds')} s{incomplete}) through `{STORE_REDIS}` after the rounds, between two readings of "
        f"the store taken {STORE_SETTLE_SECONDS:g} s after the writes behind settled ({before['keys']:,} keys "
        f"before, {after['keys']:,} after; the live-session set `{STORE_PREFIX}live` grew from "
        f"{before['live_members']:,} to {after['live_members']:,} members, {after['live_encoding']}).",
        "",
        "| measure | bytes | per new session |",
        "|---|---:|---:|",
        row("whole store: `INFO memory` used_memory after - before (judged)", used, used / n if n > 0 else None),
        row(
            f"session hash: `MEMORY USAGE` (SAMPLES 0), mean of {hashes.get('sampled', 0)} keys "
            f"({hashes.get('encoding', '?')}, {hashes.get('fields', '?')} fields; min {hashes.get('min', '—')}, "
            f"max {hashes.get('max', '—')})",
            None,
            hash_mean,
        ),
        row(
            f"live-session sorted set: `MEMORY USAGE {STORE_PREFIX}live` after - before",
            live,
            live / n if n > 0 else None,
        ),
        row(
            "keyspace hash tables (main + expires: buckets and entries): `MEMORY STATS` after - before",
            tables,
            tables / n if n > 0 else None,
        ),
        row(
            "rest: the first row minus the three above (the key's entry in the main table is counted twice, "
            "in the hash's `MEMORY USAGE` and in the tables, so this can come out below 0)",
            None,
            rest,
        ),
    ]
    if n > 0 and made.get("requests"):
        lines += [
            "",
            f"Store traffic of the prefill ({made['requests']:,.0f} proxied requests, each a new session): "
            f"{made.get('round_trips', 0) / made['requests']:.3f} round trips and "
            f"{made.get('commands', 0) / made['requests']:.3f} commands per request "
            f"({made.get('ops:load:ok', 0):,.0f} loads, {made.get('ops:flush:ok', 0):,.0f} flushes). "
            "MEMORY USAGE leaves out a key's entry in the expires table; the hash tables grow in powers of "
            "two, so their part per session depends on where the key count falls.",
        ]
    return lines


def markdown(
    rows: Sequence[Row],
    stream_rows: Sequence[StreamRow],
    target_list: Sequence[Target],
    args: argparse.Namespace,
    meta: dict[str, Any],
    store: tuple[Sequence[StoreRow], CaseResult] | None = None,
) -> str:
    lines: list[str] = []
    if meta["non_default"]:
        lines += [
            f"Parameters differing from the defaults: {', '.join(meta['non_default'])}. "
            "A run with fewer rounds or shorter runs than the defaults is a smoke test, not a measurement.",
            "",
        ]
    if args.baseline is not None:
        lines += [f"sidecar(baseline): the fast engine of {baseline_commit(args.baseline)}, from {args.baseline}.", ""]
    if rows:
        lines += request_table(rows, args)
    if stream_rows:
        lines += ["", *stream_table(stream_rows, args), *split_table(stream_rows), *growth_table(stream_rows)]
    if store is not None:
        lines += [*([""] if lines and lines[-1] else []), *store_table(store[0], store[1], args)]
    lines += ["", "## Targets", "", "| target | contender | measured | verdict |", "|---|---|---:|---|"]
    lines += [f"| {t.case}: {t.text} | {t.contender} | {measured_text(t)} | {cell(t.verdict)} |" for t in target_list]
    if statement := polling_statement(target_list):
        lines += ["", statement]
    if meta["failed_cases"]:
        lines += [
            "",
            "Cases that failed (no results):",
            "",
            *(f"- {key}: {cell(reason)}" for key, reason in meta["failed_cases"].items()),
        ]
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    lines += ["", f"Tool versions: {versions}."]
    return "\n".join(lines).lstrip("\n") + "\n"


# ---------------------------------------------------------------------------------------------
# Entry point


def build_parser() -> argparse.ArgumentParser:
    cases = make_cases(None)
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="cases:\n" + "\n".join(f"  {c.key}  {c.name:<13} {c.title}" for c in cases.values()),
    )
    p.add_argument("--cases", default=",".join(cases), help="comma-separated case letters or names (default: all)")
    p.add_argument(
        "--engines", default=",".join(ENGINES), help="sidecar engines, comma-separated (default: fast,aiohttp)"
    )
    p.add_argument(
        "--baseline",
        type=Path,
        help="another checkout of the sidecar, built in its own .venv: its fast engine joins the run as "
        "sidecar(baseline), a before/after comparison measured in the same rounds (not in case i)",
    )
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case (default 5)")
    p.add_argument("--duration", type=float, default=5, help="seconds per measured wrk run (default 5)")
    p.add_argument("--warmup", type=float, default=1, help="seconds of wrk warm-up per contender and case (default 1)")
    p.add_argument("--prefill", type=int, default=1_000_000, help="live sessions for case e (default 1000000)")
    p.add_argument(
        "--prefill-timeout", type=float, default=1200, help="upper bound of one prefill, seconds (default 1200)"
    )
    p.add_argument(
        "--store-prefill",
        type=int,
        default=100_000,
        help="new sessions sent through the Redis store for case i's bytes per session (default 100000)",
    )
    p.add_argument("--stream-n", type=int, default=200, help="concurrent streams in case f (default 200)")
    p.add_argument("--stream-n-large", type=int, default=1000, help="concurrent streams in case g (default 1000)")
    p.add_argument("--stream-events", type=int, default=100, help="events per stream (default 100)")
    p.add_argument(
        "--stream-waves",
        type=int,
        default=3,
        help="measured streams per connection in a run, each started as the last ends (default 3)",
    )
    p.add_argument("--stream-gap-ms", type=float, default=20, help="pacing of each stream's events (default 20)")
    p.add_argument("--stream-bytes", type=int, default=110, help="bytes per event, at least 89 (default 110)")
    p.add_argument(
        "--stream-timeout",
        type=float,
        default=30,
        help="seconds a stream run may take beyond twice its nominal length (default 30)",
    )
    p.add_argument(
        "--out-dir", type=Path, default=record.RESULTS, help="where the dated .md and .json go (default bench/results)"
    )
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    by_name = {name: key for key, name in CASE_NAMES.items()}
    keys = [by_name.get(c.strip(), c.strip()) for c in args.cases.split(",") if c.strip()]
    unknown = [k for k in keys if k not in CASE_NAMES]
    if unknown:
        p.error(f"--cases: unknown {unknown}; choose from {', '.join(f'{k}/{n}' for k, n in CASE_NAMES.items())}")
    args.cases = keys
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if bad := [e for e in args.engines if e not in ENGINES]:
        p.error(f"--engines: unknown {bad}; choose from {', '.join(ENGINES)}")
    if args.baseline is not None:
        if not (args.baseline / ".venv" / "bin" / "python").exists():
            p.error(f"--baseline: no .venv/bin/python in {args.baseline} (build that checkout first)")
        args.baseline = args.baseline.resolve()
        args.engines.append(BASELINE)
    if args.rounds < 1 or args.duration < 1 or args.warmup < 1 or args.prefill < 1 or args.store_prefill < 1:
        p.error("--rounds, --duration, --warmup, --prefill and --store-prefill must be >= 1")
    if (
        min(args.stream_n, args.stream_n_large, args.stream_events, args.stream_waves) < 1
        or args.stream_gap_ms <= 0
        or args.stream_bytes < 89
        or args.stream_timeout <= 0
    ):
        p.error(
            "--stream-n, --stream-n-large, --stream-events and --stream-waves must be >= 1, --stream-gap-ms and "
            "--stream-timeout > 0, --stream-bytes >= 89"
        )
    return args


def non_default(args: argparse.Namespace) -> list[str]:
    """The options given with a value other than their default, as --name value."""
    defaults = parse_args([])
    out = []
    for name, value in vars(args).items():
        if value != getattr(defaults, name):
            shown = ",".join(value) if isinstance(value, list) else value
            out.append(f"--{name.replace('_', '-')} {shown}")
    return out


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tools_dir = Path(os.environ.get("SIDECAR_TOOLS_DIR") or REPO / ".tools")
    try:
        tools = find_tools(tools_dir, args.cases)
    except BenchError as exc:
        print(f"proxy_bench: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    raise_file_limit()
    facts = record.machine_facts(wake_cores=(PROXY_CPU, LOAD_CPU))
    meta: dict[str, Any] = {
        "versions": tool_versions(tools),
        "non_default": non_default(args),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "pinning": {"proxy_cpu": PROXY_CPU, "load_cpu": LOAD_CPU},
    }
    cases = make_cases(args)
    results: dict[str, CaseResult] = {}
    failed: dict[str, str] = {}
    workdir = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    procs = Processes(tools, workdir)
    try:
        lab = Lab(tools, procs, workdir)
        if any(not cases[key].streams for key in args.cases):
            lab.start_upstream()
        for key in args.cases:
            case = cases[key]
            log(f"case {case.key} ({case.name}): {case.title}")
            try:
                results[key] = run_case(lab, case, args)
            except BenchError as exc:  # the other cases still run and the results are written
                failed[key] = str(exc)
                log(f"case {case.key} failed: {exc}")
    except BenchError as exc:
        print(f"proxy_bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("proxy_bench: interrupted", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)

    rows = [row for r in results.values() if not r.case.streams and not r.case.store for row in summarize(r)]
    stream_rows = [row for r in results.values() if r.case.streams for row in summarize_streams(r)]
    store_rows = [row for r in results.values() if r.case.store for row in summarize_store(r)]
    target_list = targets(results, [*rows, *stream_rows]) + store_targets(results, store_rows)
    meta["failed_cases"] = failed
    store = (store_rows, results["i"]) if "i" in results else None
    body = markdown(rows, stream_rows, target_list, args, meta, store)
    raw = {
        **meta,
        "cases": {
            k: {
                "name": r.case.name,
                "title": r.case.title,
                "connections": r.case.connections,
                "streams": r.case.streams,
                "skipped": r.skipped,
                "info": r.info,
                "runs": [asdict(run) for run in r.runs],
                "stream_runs": [asdict(run) for run in r.stream_runs],
            }
            for k, r in results.items()
        },
        "rows": [asdict(row) for row in rows],
        "stream_rows": [asdict(row) for row in stream_rows],
        "store_rows": [asdict(row) for row in store_rows],
        "targets": [asdict(t) for t in target_list],
    }
    md, js = record.write("proxy_bench", f"Proxy benchmark, {facts['date'][:10]}", body, raw, facts, args.out_dir)
    print(body)
    print(f"written: {md}, {js}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
