"""Proxy benchmark: the sidecar against nginx and Envoy doing the same header injection.

    python bench/proxy_bench.py [--cases a,b,c,d,e] [--engines fast,aiohttp] [--rounds 5]
                                [--duration 5] [--warmup 1] [--prefill 1000000]

Run it with the project's interpreter (.venv/bin/python); scripts/install_bench_tools.sh
installs nginx, wrk and Envoy. Everything listens on 127.0.0.1 and every process started here is
stopped by its process group on exit, Ctrl-C included.

Layout on a two-core machine: the proxy under test runs on core 0; the load generator (wrk) and
a fixed-answer nginx standing in for the inference gateway share core 1. Each case starts its
contenders side by side and measures them in interleaved rounds (each round runs every
contender once, in rotating order), so slow drifts of a shared machine weigh on all of them
alike; ratios are taken within a round and the median over rounds is reported.

Cases:
  a  header-64c  POST, 1 KiB JSON body, X-Correlation-ID over 1000 ids, 64 connections
  b  header-1c   the same over one connection: per-request latency
  c  nvext       the sidecar in dynamo_nvext (body) mode against its own header mode
  d  sse         GET a 20-event text/event-stream response, 64 connections
  e  sessions    header mode with --prefill live sessions in the session tree against 1000

Writes bench/results/latest.json (every run) and bench/results/latest.md (the table).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"

PROXY_CPU = 0
LOAD_CPU = 1
HOST = "127.0.0.1"
ENGINES = ("fast", "aiohttp")
CHAT_PATH = "/v1/chat/completions"
SSE_PATH = "/v1/sse"
SSE_EVENTS = 20
MEASURED_IDS = 1000
PREFILL_CONNECTIONS = 256
START_TIMEOUT = 20.0
STOP_GRACE = 5.0

SESSION_HEADER = "X-Correlation-ID"
SEEN_SESSION = "X-Seen-Session-ID"
SEEN_LENGTH = "X-Seen-Content-Length"

# Targets; verdicts are computed in targets().
TARGET_HEADER_VS_ENVOY = 1.5
TARGET_P50_VS_NGINX = 1.1
TARGET_NVEXT_VS_HEADER = 0.7
TARGET_SESSIONS_VS_1K = 0.9


class BenchError(Exception):
    """A condition that stops the benchmark, with a message for the person running it."""


# ---------------------------------------------------------------------------------------------
# Tools and processes


@dataclass(frozen=True)
class Tools:
    nginx: str
    wrk: str
    envoy: str
    taskset: str


def find_tools(tools_dir: Path) -> Tools:
    envoy = tools_dir / "bench" / "bin" / "envoy"
    found = {
        "nginx": shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin"),
        "wrk": shutil.which("wrk"),
        "envoy": str(envoy) if os.access(envoy, os.X_OK) else None,
        "taskset": shutil.which("taskset"),
    }
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise BenchError(
            f"missing benchmark tools: {', '.join(missing)} (envoy is looked for at {envoy}).\n"
            f"Install them with scripts/install_bench_tools.sh (run as root; it puts Envoy in "
            f"$SIDECAR_TOOLS_DIR/bench, default .tools/bench).")
    if (os.cpu_count() or 1) < 2:
        raise BenchError("needs two CPU cores: one for the proxy, one for wrk and the upstream")
    return Tools(**found)  # type: ignore[arg-type]


def tool_versions(tools: Tools) -> dict[str, str]:
    def probe(argv: list[str], pattern: str = r".+") -> str:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        match = re.search(pattern, out.stdout + out.stderr)
        return match.group(match.re.groups).strip() if match else "unknown"

    versions = {
        "nginx": probe([tools.nginx, "-v"], r"nginx/(\S+)"),
        "wrk": probe([tools.wrk, "-v"], r"wrk (\S+)"),
        "envoy": probe([tools.envoy, "--version"], r"[0-9a-f]{40}/([^/ \n]+)"),
        "sidecar": probe([sys.executable, "-m", "sidecar", "--version"], r"sidecar (\S+)"),
        # compiled (setup.py) or the pure-Python sources (no C compiler, or SIDECAR_PURE_PYTHON=1)
        "fast engine compiled": probe([sys.executable, "-c", "from sidecar.engine.fast import FastEngine as F; "
                                       "print(F.compiled)"]),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }
    with contextlib.suppress(Exception):
        git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        versions["commit"] = git.stdout.strip() or "unknown"
    with contextlib.suppress(OSError):
        model = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        versions["cpu"] = model.group(1).strip() if model else "unknown"
    return versions


class Processes:
    """Every long-running process the benchmark starts: each leads its own process group, pinned
    to one core with taskset, and is stopped by that group (TERM, then KILL after a grace)."""

    def __init__(self, tools: Tools, log_dir: Path) -> None:
        self._tools = tools
        self._log_dir = log_dir
        self._running: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: Sequence[str], cpu: int) -> subprocess.Popen[bytes]:
        with open(self.log_path(name), "wb") as log:
            proc = subprocess.Popen([self._tools.taskset, "-c", str(cpu), *argv], cwd=REPO,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
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


def render(template: str, prefix: Path, **values: int) -> str:
    text = (BENCH / template).read_text()
    user = "user root;" if os.geteuid() == 0 else ""
    text = text.replace("@USER@", user).replace("@PREFIX@", str(prefix))
    for key, value in values.items():
        text = text.replace(f"@{key.upper()}@", str(value))
    if leftover := re.findall(r"@[A-Z_]+@", text):
        raise BenchError(f"{template}: unfilled placeholders {leftover}")
    return text


def group_cpu_seconds(pgid: int) -> float:
    """CPU time (user + system) used so far by the processes of one process group: the
    contender's own consumption, whatever else the shared machine runs on its core."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended meanwhile
        if int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


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
    kind: str  # sidecar | nginx | envoy
    engine: str | None = None
    mode: str = "dynamo_headers"
    prefill: int = 0
    baseline_of: str | None = None  # group whose subject is compared with this one (c, e)
    subject_of: str | None = None
    idle_poll_us: int | None = None  # the sidecar's idle_poll_us setting; None: its default


@dataclass
class Contender:
    spec: Spec
    port: int
    proc: subprocess.Popen[bytes]
    log_name: str
    admin_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def http_request(port: int, method: str, path: str, headers: dict[str, str] | None = None,
                 body: bytes | None = None, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def verify(contender: Contender, sse: bool) -> None:
    """One request through the contender: it must answer 200 and the upstream must have seen
    the session header (header mode) or a rewritten body (dynamo_nvext)."""
    session = "verify-0001"
    body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, headers, _ = http_request(contender.port, "POST", CHAT_PATH, {
        SESSION_HEADER: session, "Content-Type": "application/json"}, body)
    if status != 200:
        raise BenchError(f"POST {CHAT_PATH} answered {status}")
    if contender.spec.mode == "dynamo_nvext":
        seen = int(headers.get(SEEN_LENGTH.lower(), "0") or 0)
        if seen <= len(body):
            raise BenchError(f"dynamo_nvext did not rewrite the body (upstream saw {seen} bytes)")
    elif headers.get(SEEN_SESSION.lower()) != session:
        raise BenchError(f"upstream saw X-Dynamo-Session-ID {headers.get(SEEN_SESSION.lower())!r}, "
                         f"expected {session!r}")
    if sse:
        status, headers, payload = http_request(contender.port, "GET", SSE_PATH, {SESSION_HEADER: session})
        events = payload.count(b"data: ")
        if status != 200 or not headers.get("content-type", "").startswith("text/event-stream") \
                or events != SSE_EVENTS + 1:
            raise BenchError(f"GET {SSE_PATH}: status {status}, {events} events, "
                             f"content-type {headers.get('content-type')!r}")


def wait_until(ready: Callable[[], None], proc: subprocess.Popen[bytes], timeout: float = START_TIMEOUT) -> None:
    """Poll ``ready()`` until it returns without raising; fail if the process exits first."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"exited with status {proc.returncode}")
        try:
            ready()
            return
        except (OSError, http.client.HTTPException, ValueError, BenchError) as exc:
            last = exc
        time.sleep(0.2)
    raise BenchError(f"not ready after {timeout:.0f} s ({last})")


class Lab:
    """The running upstream plus the means to start contenders in front of it."""

    def __init__(self, tools: Tools, procs: Processes, workdir: Path) -> None:
        self.tools = tools
        self.procs = procs
        self.workdir = workdir
        self.upstream_port = 0
        self._count = 0

    def _prefix(self, name: str) -> Path:
        prefix = self.workdir / name
        for sub in ("", "client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (prefix / sub).mkdir(parents=True, exist_ok=True)
        return prefix

    def _nginx(self, name: str, template: str, port: int, cpu: int, **values: int) -> subprocess.Popen[bytes]:
        prefix = self._prefix(name)
        (prefix / "nginx.conf").write_text(render(template, prefix, listen_port=port, **values))
        return self.procs.start(name, [self.tools.nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf"),
                                       "-e", str(prefix / "error.log")], cpu)

    def start_upstream(self) -> None:
        port = free_port()
        prefix = self._prefix("upstream")
        chunk = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "model": "bench"}
        events = "".join(
            f"data: {json.dumps({**chunk, 'choices': [{'index': 0, 'delta': {'content': f'token{i} '}}]})}\n\n"
            for i in range(SSE_EVENTS))
        (prefix / "events").write_text(events + "data: [DONE]\n\n")
        proc = self._nginx("upstream", "nginx/upstream.conf", port, LOAD_CPU)

        def ready() -> None:
            status, headers, _ = http_request(port, "POST", CHAT_PATH, {"X-Dynamo-Session-ID": "probe"}, b"{}")
            if status != 200 or headers.get(SEEN_SESSION.lower()) != "probe":
                raise BenchError(f"upstream answered {status}")

        try:
            wait_until(ready, proc)
        except BenchError as exc:
            raise BenchError(f"the nginx upstream did not start: {exc}: {self.procs.log_tail('upstream')}") from exc
        self.upstream_port = port

    def start(self, spec: Spec, sessions: dict[str, int] | None, sse: bool) -> Contender:
        """Start one contender on the proxy core and check it proxies correctly; BenchError
        (with the reason) if it does not start or misbehaves, after stopping it."""
        self._count += 1
        name = f"{self._count:02d}-{re.sub(r'[^a-z0-9]+', '-', spec.label.lower()).strip('-')}"
        port, sidecar_admin_port = free_ports(2)
        admin_port = None
        if spec.kind == "nginx":
            proc = self._nginx(name, "nginx/proxy.conf", port, PROXY_CPU, upstream_port=self.upstream_port)
        elif spec.kind == "envoy":
            prefix = self._prefix(name)
            conf = prefix / "envoy.yaml"
            conf.write_text(render("envoy/envoy.yaml", prefix, listen_port=port, upstream_port=self.upstream_port))
            proc = self.procs.start(name, [self.tools.envoy, "-c", str(conf), "--concurrency", "1",
                                           "--log-level", "warning", "--disable-hot-restart"], PROXY_CPU)
        else:
            admin_port = sidecar_admin_port
            prefix = self._prefix(name)
            config: dict[str, Any] = {"drain_grace_seconds": 1}
            if sessions:
                config["sessions"] = sessions
            if spec.idle_poll_us is not None:
                config["idle_poll_us"] = spec.idle_poll_us
            conf = prefix / "sidecar.yaml"
            conf.write_text(json.dumps(config))  # JSON is YAML
            proc = self.procs.start(name, [
                sys.executable, "-m", "sidecar", "run", "--listen", f"{HOST}:{port}",
                "--admin", f"{HOST}:{admin_port}", "--upstream", f"http://{HOST}:{self.upstream_port}",
                "--mode", spec.mode, "--engine", str(spec.engine), "--log-level", "warning",
                "--config", str(conf)], PROXY_CPU)
        contender = Contender(spec, port, proc, name, admin_port)
        try:
            wait_until(lambda: verify(contender, sse), proc)
        except BenchError as exc:
            self.procs.stop(proc)
            tail = self.procs.log_tail(name)
            raise BenchError(f"{exc}{': ' + tail if tail else ''}") from exc
        return contender

    def live_sessions(self, contender: Contender) -> int | None:
        if contender.admin_port is None:
            return None
        with contextlib.suppress(OSError, http.client.HTTPException):
            _, _, body = http_request(contender.admin_port, "GET", "/metrics", timeout=30)
            match = re.search(rb"^sidecar_live_sessions (\S+)$", body, re.MULTILINE)
            if match:
                return int(float(match.group(1)))
        return None


# ---------------------------------------------------------------------------------------------
# Load


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


def wrk_argv(tools: Tools, url: str, script: str, connections: int, duration: float,
             script_args: Sequence[str]) -> list[str]:
    return [tools.taskset, "-c", str(LOAD_CPU), tools.wrk, "-t1", f"-c{connections}",
            f"-d{max(1, round(duration))}s", "--timeout", "5s", "--latency",
            "-s", str(BENCH / "wrk" / script), url, "--", *script_args]


def parse_wrk(stdout: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        if line.startswith('{"wrk":'):
            result: dict[str, Any] = json.loads(line)
            return result
    raise BenchError(f"wrk printed no result line:\n{stdout[-2000:]}")


def run_wrk(argv: list[str], timeout: float) -> dict[str, Any]:
    # wrk is started through Popen directly (it is already pinned by argv) so that it too leads
    # its own group and is killed by PID on any exit path.
    proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return parse_wrk(stdout.decode(errors="replace"))


def measure(tools: Tools, case: str, contender: Contender, round_: int,
            connections: int, duration: float, script_args: Sequence[str]) -> Run:
    argv = wrk_argv(tools, contender.url, "post.lua", connections, duration, script_args)
    cpu0 = group_cpu_seconds(contender.proc.pid)
    result = run_wrk(argv, timeout=duration + 30)
    cpu1 = group_cpu_seconds(contender.proc.pid)
    seconds = result["duration_us"] / 1e6 or 1e-9
    requests = result["requests"]
    cpu = cpu1 - cpu0
    return Run(case=case, contender=contender.spec.label, round=round_, rps=requests / seconds,
               p50_ms=result["p50_us"] / 1000, p99_ms=result["p99_us"] / 1000, requests=requests,
               seconds=round(seconds, 3), errors=sum(result["errors"].values()),
               proxy_cpu_share=round(cpu / seconds, 3),
               requests_per_cpu_second=round(requests / cpu) if cpu else 0.0,
               load_average=os.getloadavg()[0])


def prefill(tools: Tools, contender: Contender, total: int, timeout: float) -> dict[str, Any]:
    """Open `total` sessions through the contender with unique ids (bench/wrk/prefill.lua)."""
    argv = wrk_argv(tools, contender.url, "prefill.lua", PREFILL_CONNECTIONS, timeout, [str(total)])
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)
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
    return {"requests": result["requests"], "seconds": round(time.monotonic() - t0, 1),
            "errors": sum(result["errors"].values()),
            "completed": any(line.strip() == "prefill-complete" for line in lines)}


# ---------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    key: str
    name: str
    title: str
    connections: int
    script_args: tuple[str, ...]
    sse: bool = False


def sidecar(engine: str) -> str:
    return f"sidecar({engine})"


def human(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


POST_ARGS = (str(MEASURED_IDS), "POST", CHAT_PATH, "1024")
CASES = {
    "a": Case("a", "header-64c", "header mode, 64 connections", 64, POST_ARGS),
    "b": Case("b", "header-1c", "header mode, 1 connection", 1, POST_ARGS),
    "c": Case("c", "nvext", "dynamo_nvext body mode, 64 connections", 64, POST_ARGS),
    "d": Case("d", "sse", f"SSE response ({SSE_EVENTS} events), 64 connections", 64,
              (str(MEASURED_IDS), "GET", SSE_PATH), sse=True),
    "e": Case("e", "sessions", "header mode, prefilled session tree, 64 connections", 64, POST_ARGS),
}


def specs_for(case: Case, engines: Sequence[str], prefill_n: int) -> list[Spec]:
    if case.key == "c":
        return [spec for e in engines for spec in (
            Spec(f"{sidecar(e)} headers", "sidecar", e, baseline_of=e),
            Spec(f"{sidecar(e)} nvext", "sidecar", e, mode="dynamo_nvext", subject_of=e))]
    if case.key == "e":
        return [spec for e in engines for spec in (
            Spec(f"{sidecar(e)} 1k sessions", "sidecar", e, baseline_of=e),
            Spec(f"{sidecar(e)} {human(prefill_n)} sessions", "sidecar", e, prefill=prefill_n, subject_of=e))]
    # At one connection, also the fast engine with idle polling off: what polling buys, at what CPU.
    no_poll = [Spec(f"{sidecar('fast')} idle poll off", "sidecar", "fast", idle_poll_us=0)] if (
        case.key == "b" and "fast" in engines) else []
    return [*(Spec(sidecar(e), "sidecar", e) for e in engines), *no_poll, Spec("nginx", "nginx"),
            Spec("envoy", "envoy")]


@dataclass
class CaseResult:
    case: Case
    specs: list[Spec]
    skipped: dict[str, str] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    info: dict[str, dict[str, Any]] = field(default_factory=dict)


def log(message: str) -> None:
    print(f"[proxy_bench] {message}", file=sys.stderr, flush=True)


def run_case(lab: Lab, case: Case, args: argparse.Namespace) -> CaseResult:
    result = CaseResult(case, specs_for(case, args.engines, args.prefill))
    sessions = ({"max_live_sessions": max(2_000_000, 2 * args.prefill), "idle_ttl_seconds": 36000}
                if case.key == "e" else None)
    running: list[Contender] = []
    try:
        for spec in result.specs:
            try:
                running.append(lab.start(spec, sessions, case.sse))
            except BenchError as exc:
                result.skipped[spec.label] = f"did not start: {exc}"
                log(f"{case.key}: {spec.label}: skipped: {exc}")
        for contender in running:
            if contender.spec.prefill:
                log(f"{case.key}: {contender.spec.label}: prefilling {contender.spec.prefill} sessions")
                info = prefill(lab.tools, contender, contender.spec.prefill, args.prefill_timeout)
                info["live_sessions"] = lab.live_sessions(contender)
                info["rss_mib"] = rss_mib(contender.proc.pid)
                result.info[contender.spec.label] = info
                log(f"{case.key}: {contender.spec.label}: prefill {info}")
        for contender in running:
            measure(lab.tools, case.key, contender, 0, case.connections, args.warmup, case.script_args)
        for round_ in range(1, args.rounds + 1):
            shift = (round_ - 1) % max(1, len(running))
            for contender in running[shift:] + running[:shift]:
                if contender.proc.poll() is not None:
                    result.skipped.setdefault(contender.spec.label,
                                              f"exited during the case: {lab.procs.log_tail(contender.log_name)}")
                    continue
                run = measure(lab.tools, case.key, contender, round_, case.connections,
                              args.duration, case.script_args)
                result.runs.append(run)
                log(f"{case.key} round {round_}: {run.contender}: {run.rps:,.0f} req/s, "
                    f"p50 {run.p50_ms:.3f} ms, p99 {run.p99_ms:.3f} ms, errors {run.errors}, "
                    f"proxy CPU {run.proxy_cpu_share:.0%}")
        for contender in running:
            if contender.spec.kind == "sidecar":
                info = result.info.setdefault(contender.spec.label, {})
                info["rss_mib_end"] = rss_mib(contender.proc.pid)
                info["live_sessions_end"] = lab.live_sessions(contender)
    finally:
        for contender in running:
            lab.procs.stop(contender.proc)
    return result


# ---------------------------------------------------------------------------------------------
# Summary


def median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def per_round(runs: list[Run], label: str) -> dict[int, Run]:
    return {run.round: run for run in runs if run.contender == label}


def round_ratio(runs: list[Run], num: str, den: str, metric: str = "rps") -> float | None:
    """Median over rounds of num/den, each ratio taken within one round."""
    a, b = per_round(runs, num), per_round(runs, den)
    ratios = [getattr(a[r], metric) / getattr(b[r], metric) for r in a.keys() & b.keys()
              if getattr(b[r], metric)]
    return median_or_none(ratios)


@dataclass
class Row:
    case: str
    contender: str
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    vs_envoy: float | None = None
    vs_nginx: float | None = None
    case_ratio: float | None = None
    proxy_cpu_share: float | None = None
    requests_per_cpu_second: float | None = None
    errors: int = 0
    note: str = ""


def summarize(result: CaseResult) -> list[Row]:
    rows = []
    runs = result.runs
    labels = {run.contender for run in runs}
    for spec in result.specs:
        row = Row(f"{result.case.key} {result.case.name}", spec.label)
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
        if "envoy" in labels and spec.label != "envoy":
            row.vs_envoy = round_ratio(runs, spec.label, "envoy")
        if "nginx" in labels and spec.label != "nginx":
            row.vs_nginx = round_ratio(runs, spec.label, "nginx")
            if result.case.key == "b":
                row.case_ratio = round_ratio(runs, spec.label, "nginx", "p50_ms")
        if spec.subject_of:
            base = next(s.label for s in result.specs if s.baseline_of == spec.subject_of)
            row.case_ratio = round_ratio(runs, spec.label, base)
        info = result.info.get(spec.label, {})
        if spec.prefill:
            incomplete = "" if info.get("completed") else " (INCOMPLETE: --prefill-timeout reached)"
            row.note = (f"prefill{incomplete}: {info.get('live_sessions_end') or info.get('live_sessions')} "
                        f"live sessions, {info.get('seconds')} s, RSS {info.get('rss_mib_end') or 0:.0f} MiB")
        elif spec.label in result.skipped:
            row.note = result.skipped[spec.label]
        rows.append(row)
    return rows


@dataclass
class Target:
    text: str
    contender: str
    measured: float | None
    verdict: str


def targets(results: dict[str, CaseResult], rows: list[Row], engines: Sequence[str], prefill_n: int) -> list[Target]:
    """PASS / FAIL per target and engine. Targets a and b are set for the fast engine; for the
    others they are shown for reference. A comparison with wrk errors on either side, or against
    an incomplete prefill, cannot pass."""
    by = {(row.case.split()[0], row.contender): row for row in rows}
    sessions = human(prefill_n)
    # (case, target, contender label and reference label for an engine, Row attribute, threshold,
    #  lower is better, set for the fast engine only)
    definitions: list[tuple[str, str, Callable[[str], str], Callable[[str], str], str, float, bool, bool]] = [
        ("a", f"header 64c: req/s >= {TARGET_HEADER_VS_ENVOY}x Envoy", sidecar, lambda e: "envoy",
         "vs_envoy", TARGET_HEADER_VS_ENVOY, False, True),
        ("b", f"header 1c: p50 <= {TARGET_P50_VS_NGINX}x nginx p50", sidecar, lambda e: "nginx",
         "case_ratio", TARGET_P50_VS_NGINX, True, True),
        ("c", f"dynamo_nvext: req/s >= {TARGET_NVEXT_VS_HEADER}x own header mode",
         lambda e: f"{sidecar(e)} nvext", lambda e: f"{sidecar(e)} headers",
         "case_ratio", TARGET_NVEXT_VS_HEADER, False, False),
        ("e", f"{sessions} sessions: req/s >= {TARGET_SESSIONS_VS_1K}x 1k sessions",
         lambda e: f"{sidecar(e)} {sessions} sessions", lambda e: f"{sidecar(e)} 1k sessions",
         "case_ratio", TARGET_SESSIONS_VS_1K, False, False),
    ]
    out = []
    for case, text, label_of, reference_of, attribute, threshold, at_most, fast_only in definitions:
        if case not in results:
            continue
        for engine in engines:
            label = label_of(engine)
            row = by.get((case, label))
            reference = by.get((case, reference_of(engine)))
            value = getattr(row, attribute) if row else None
            errors = (row.errors if row else 0) + (reference.errors if reference else 0)
            if row is None or value is None:
                skipped = results[case].skipped.get(label)
                verdict = f"SKIP ({skipped})" if skipped else "SKIP (not measured)"
            elif errors:
                verdict = f"INVALID ({errors} wrk errors)"
            elif case == "e" and not results[case].info.get(label, {}).get("completed"):
                live = results[case].info.get(label, {}).get("live_sessions")
                verdict = f"INVALID (prefill incomplete: {live} live sessions)"
            else:
                met = value <= threshold if at_most else value >= threshold
                if fast_only and engine != "fast":
                    verdict = f"info ({'meets' if met else 'misses'} the target set for sidecar(fast))"
                else:
                    verdict = "PASS" if met else "FAIL"
            out.append(Target(text, label, value, verdict))
    return out


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[Row], target_list: list[Target], meta: dict[str, Any]) -> str:
    a = meta["args"]
    lines = [
        f"Proxy benchmark, {meta['date']}: {a['rounds']} interleaved rounds x {a['duration']} s per "
        f"contender and case (warm-up {a['warmup']} s), wrk -t1, proxy on core {PROXY_CPU}, "
        f"wrk + nginx upstream on core {LOAD_CPU}.",
        "",
        "| case | contender | req/s | p50 ms | p99 ms | x Envoy | x nginx | case ratio | proxy CPU | req/CPU-s "
        "| errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for row in rows:
        if row.rps is None:
            lines.append(f"| {row.case} | {row.contender} | skipped | | | | | | | | |")
            notes.append(f"- {row.case} / {row.contender}: {cell(row.note)}")
            continue
        lines.append(
            f"| {row.case} | {row.contender} | {fmt(row.rps, ',.0f')} | {fmt(row.p50_ms, '.3f')} | "
            f"{fmt(row.p99_ms, '.3f')} | {fmt(row.vs_envoy, '.2f')} | {fmt(row.vs_nginx, '.2f')} | "
            f"{fmt(row.case_ratio, '.2f')} | {fmt(row.proxy_cpu_share, '.0%')} | "
            f"{fmt(row.requests_per_cpu_second, ',.0f')} | {row.errors} |")
        if row.note:
            notes.append(f"- {row.case} / {row.contender}: {cell(row.note)}")
    lines += [
        "",
        "Ratios are medians of per-round ratios. case ratio: (b) p50 / nginx p50; (c) req/s / the same "
        "engine in header mode; (e) req/s / the same engine at 1k sessions. proxy CPU: CPU time the "
        "contender's processes used over the run's wall time (near 100%: the proxy was the limit; well "
        "below: the load side, or other processes sharing the core). req/CPU-s: requests per second "
        "of the contender's own CPU time, which other load on the machine disturbs less.",
    ]
    if notes:
        lines += ["", *notes]
    lines += ["", "| target | contender | measured | verdict |", "|---|---|---:|---|"]
    lines += [f"| {t.text} | {t.contender} | {fmt(t.measured, '.2f', 'x')} | {cell(t.verdict)} |" for t in target_list]
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    lines += ["", f"Versions: {versions}."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Entry point


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="cases:\n" + "\n".join(f"  {c.key}  {c.name:<11} {c.title}"
                                                                for c in CASES.values()))
    p.add_argument("--cases", default="a,b,c,d,e", help="comma-separated case letters or names (default: all)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="sidecar engines, comma-separated (default: fast,aiohttp)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case (default 5)")
    p.add_argument("--duration", type=float, default=5, help="seconds per measured run (default 5)")
    p.add_argument("--warmup", type=float, default=1, help="seconds of warm-up per contender and case (default 1)")
    p.add_argument("--prefill", type=int, default=1_000_000, help="live sessions for case e (default 1000000)")
    p.add_argument("--prefill-timeout", type=float, default=1200,
                   help="upper bound of one prefill, seconds (default 1200)")
    p.add_argument("--out-dir", type=Path, default=RESULTS, help="where latest.json / latest.md go")
    args = p.parse_args(argv)
    names = {c.name: c.key for c in CASES.values()}
    keys = [names.get(c.strip(), c.strip()) for c in args.cases.split(",") if c.strip()]
    unknown = [k for k in keys if k not in CASES]
    if unknown:
        p.error(f"--cases: unknown {unknown}; choose from {', '.join(f'{c.key}/{c.name}' for c in CASES.values())}")
    args.cases = keys
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if bad := [e for e in args.engines if e not in ENGINES]:
        p.error(f"--engines: unknown {bad}; choose from {', '.join(ENGINES)}")
    if args.rounds < 1 or args.duration < 1 or args.warmup < 1 or args.prefill < 1:
        p.error("--rounds, --duration, --warmup and --prefill must be >= 1")
    return args


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tools_dir = Path(os.environ.get("SIDECAR_TOOLS_DIR") or REPO / ".tools")
    try:
        tools = find_tools(tools_dir)
    except BenchError as exc:
        print(f"proxy_bench: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    meta: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "versions": tool_versions(tools),
                            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                            "pinning": {"proxy_cpu": PROXY_CPU, "load_cpu": LOAD_CPU}}
    results: dict[str, CaseResult] = {}
    workdir = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    procs = Processes(tools, workdir)
    try:
        lab = Lab(tools, procs, workdir)
        lab.start_upstream()
        for key in args.cases:
            case = CASES[key]
            log(f"case {case.key} ({case.name}): {case.title}")
            results[key] = run_case(lab, case, args)
    except BenchError as exc:
        print(f"proxy_bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("proxy_bench: interrupted", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)

    rows = [row for result in results.values() for row in summarize(result)]
    target_list = targets(results, rows, args.engines, args.prefill)
    table = markdown(rows, target_list, meta)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "latest.md").write_text(table)
    raw = {**meta, "cases": {k: {"name": r.case.name, "title": r.case.title, "connections": r.case.connections,
                                 "skipped": r.skipped, "info": r.info, "runs": [asdict(run) for run in r.runs]}
                             for k, r in results.items()},
           "rows": [asdict(row) for row in rows], "targets": [asdict(t) for t in target_list]}
    (args.out_dir / "latest.json").write_text(json.dumps(raw, indent=2) + "\n")
    print(table)
    print(f"written: {args.out_dir / 'latest.json'}, {args.out_dir / 'latest.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
