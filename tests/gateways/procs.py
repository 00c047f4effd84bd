"""Real processes for the gateway tests, and the client traffic sent through them.

Every server here binds 127.0.0.1 on a free port, writes its combined stdout/stderr to a log file,
is waited for with bounded polling (a startup failure raises ``StartupError`` carrying the
process's output tail), and is stopped by its PID (SIGTERM, then SIGKILL after a grace period).

Gateways are found under ``$SIDECAR_GATEWAYS_DIR`` (default ``<repo>/.gateways``), where
``scripts/install_gateways.sh`` puts them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO_ROOT = Path(__file__).resolve().parents[2]
GATEWAYS_DIR = Path(os.environ.get("SIDECAR_GATEWAYS_DIR") or REPO_ROOT / ".gateways")
INSTALL_COMMAND = "scripts/install_gateways.sh"
MODEL = "tiny"

# What each installed gateway needs: its marker file (written last by the installer) and the
# executable the tests run.
GATEWAYS: dict[str, tuple[str, str]] = {
    "smg": ("smg/.installed-smg-1.13.0", "smg/bin/smg"),
    "vllm-router": ("vllm-router/.installed-vllm-router-0.1.17", "vllm-router/bin/vllm-router"),
    "dynamo": ("dynamo/.installed-dynamo-1.6.1", "dynamo/bin/python"),
    "aiperf": ("aiperf/.installed-aiperf-0.13.0", "aiperf/bin/aiperf"),  # the load generator
}
TINY_MODEL_DIR = GATEWAYS_DIR / "tiny-model"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class StartupError(RuntimeError):
    """A process did not become ready; the message carries its output tail."""


def gateway_missing(name: str) -> str | None:
    """Why gateway ``name`` cannot be run (None when it is installed)."""
    marker, exe = GATEWAYS[name]
    missing = [p for p in (GATEWAYS_DIR / marker, GATEWAYS_DIR / exe) if not p.exists()]
    if name == "dynamo" and not (TINY_MODEL_DIR / ".complete").exists():
        missing.append(TINY_MODEL_DIR / ".complete")
    if not missing:
        return None
    return f"{name} is not installed in {GATEWAYS_DIR} (missing {missing[0]}); run {INSTALL_COMMAND}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_low_port(low: int = 20000, high: int = 32767, attempts: int = 200) -> int:
    """A free port below the kernel's ephemeral range: Dynamo 1.6.1 parses DYN_SYSTEM_PORT as
    an i16, so ports above 32767 are rejected at startup."""
    for _ in range(attempts):
        port = random.randint(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high} after {attempts} attempts")


class ManagedProcess:
    """One child process, its log file, and a PID-based stop."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        term_grace: float = 10.0,
    ) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = log_dir / f"{name}.log"
        self.term_grace = term_grace
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, "NO_COLOR": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=str(cwd or REPO_ROOT),
                start_new_session=True,
            )
        except BaseException:
            self._log.close()
            raise
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        self._log.flush()
        return _ANSI.sub("", self.log_path.read_text(errors="replace"))

    def tail(self, lines: int = 40) -> str:
        text = "\n".join(self.output().splitlines()[-lines:])
        state = "running" if self.alive() else f"exited with {self.popen.returncode}"
        return f"--- {self.name} (pid {self.pid}, {state}) output tail, {self.log_path} ---\n{text}"

    def stop(self) -> None:
        """SIGTERM the PID, wait up to ``term_grace`` seconds, then SIGKILL it."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=self.term_grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        self._log.close()


def stop_all(procs: Iterable[ManagedProcess]) -> None:
    """Stop processes in reverse start order; every one is attempted."""
    errors = []
    for proc in reversed(list(procs)):
        try:
            proc.stop()
        except Exception as exc:  # keep stopping the others
            errors.append(f"{proc.name}: {exc!r}")
    if errors:
        raise RuntimeError("could not stop: " + "; ".join(errors))


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes] | None:
    """(status, body) of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, urllib.error.URLError):
        return None


def wait_ready(
    what: str, probe: Callable[[], bool], procs: Sequence[ManagedProcess], timeout: float = 30.0, interval: float = 0.1
) -> None:
    """Poll ``probe`` until it returns True; fail early if any of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p for p in procs if not p.alive()]
        if dead:
            raise StartupError(f"{what}: process exited before it was ready\n" + "\n".join(p.tail() for p in dead))
        if probe():
            return
        time.sleep(interval)
    raise StartupError(f"{what}: not ready after {timeout:.0f} s\n" + "\n".join(p.tail() for p in procs))


def _status_is(url: str, status: int = 200) -> Callable[[], bool]:
    def probe() -> bool:
        got = http_get(url)
        return got is not None and got[0] == status

    return probe


def _json_probe(url: str, check: Callable[[Any], bool]) -> Callable[[], bool]:
    def probe() -> bool:
        got = http_get(url)
        if got is None or got[0] != 200:
            return False
        try:
            return bool(check(json.loads(got[1])))
        except ValueError:
            return False

    return probe


# ---------------------------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------------------------


@dataclass
class Stack:
    """Processes that serve together; ``url`` is where clients send requests."""

    url: str
    procs: list[ManagedProcess] = field(default_factory=list)

    def proc(self, name: str) -> ManagedProcess:
        return next(p for p in self.procs if p.name == name)

    def stop(self) -> None:
        stop_all(self.procs)


@dataclass
class MockWorker:
    name: str
    url: str
    proc: ManagedProcess

    def received(self) -> list[dict[str, Any]]:
        """Requests this worker received: ``{"method", "path", "query", "headers": {lower: v}}``."""
        got = http_get(f"{self.url}/_received")
        assert got is not None and got[0] == 200, f"{self.name}: GET /_received failed: {got}"
        requests = json.loads(got[1])["requests"]
        for r in requests:
            r["headers"] = {k.lower(): v for k, v in r["headers"]}
        return requests

    def clear_received(self) -> None:
        req = urllib.request.Request(f"{self.url}/_received", method="DELETE")
        with urllib.request.urlopen(req, timeout=2) as resp:
            assert resp.status == 200


def start_mock_workers(
    names: Sequence[str], log_dir: Path, *, owned_by: str = "vllm", timeout: float = 15.0
) -> list[MockWorker]:
    workers: list[MockWorker] = []
    try:
        for name in names:
            port = free_port()
            proc = ManagedProcess(
                f"mock-{name}",
                [
                    sys.executable,
                    "-m",
                    "tests.gateways.mock_worker",
                    "--port",
                    port,
                    "--name",
                    name,
                    "--model",
                    MODEL,
                    "--owned-by",
                    owned_by,
                ],
                log_dir,
                term_grace=5,
            )
            workers.append(MockWorker(name, f"http://127.0.0.1:{port}", proc))
        for w in workers:
            wait_ready(f"mock worker {w.name}", _status_is(f"{w.url}/health"), [w.proc], timeout)
    except BaseException:
        stop_all(w.proc for w in workers)
        raise
    return workers


def start_smg(
    worker_urls: Sequence[str],
    log_dir: Path,
    *,
    policy: str = "manual",
    extra_args: Sequence[str] = (),
    timeout: float = 30.0,
) -> Stack:
    """SMG ``launch`` in front of ``worker_urls``; ready once every worker is registered."""
    port, metrics_port = free_port(), free_port()
    exe = GATEWAYS_DIR / GATEWAYS["smg"][1]
    # SMG drains for ~7 s on SIGTERM; nothing here needs a graceful drain.
    proc = ManagedProcess(
        "smg",
        [
            exe,
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            port,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            metrics_port,
            "--worker-urls",
            *worker_urls,
            "--policy",
            policy,
            *extra_args,
        ],
        log_dir,
        term_grace=2,
    )
    stack = Stack(f"http://127.0.0.1:{port}", [proc])

    def all_registered(body: Any) -> bool:
        ready = {w["url"] for w in body.get("workers", []) if w.get("is_healthy") and w.get("status") == "ready"}
        return ready >= set(worker_urls)

    try:
        wait_ready("smg", _json_probe(f"{stack.url}/workers", all_registered), [proc], timeout)
    except BaseException:
        stack.stop()
        raise
    return stack


def start_vllm_router(
    worker_urls: Sequence[str],
    log_dir: Path,
    *,
    policy: str = "sticky_least_loaded",
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> Stack:
    """vllm-router in front of ``worker_urls`` (it waits for healthy workers before serving)."""
    port, metrics_port = free_port(), free_port()
    exe = GATEWAYS_DIR / GATEWAYS["vllm-router"][1]
    proc = ManagedProcess(
        "vllm-router",
        [
            exe,
            "--host",
            "127.0.0.1",
            "--port",
            port,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            metrics_port,
            "--worker-urls",
            *worker_urls,
            "--policy",
            policy,
            *extra_args,
        ],
        log_dir,
        env=env,
        term_grace=5,
    )
    stack = Stack(f"http://127.0.0.1:{port}", [proc])
    try:
        wait_ready("vllm-router", _status_is(f"{stack.url}/health"), [proc], timeout)
    except BaseException:
        stack.stop()
        raise
    return stack


# XSUB/XPUB relay so Dynamo's ZMQ event publishers connect to loopback instead of binding
# 0.0.0.0 (DYN_ZMQ_BROKER_URL).
_ZMQ_RELAY = """
import sys, zmq
ctx = zmq.Context()
xsub = ctx.socket(zmq.XSUB); xsub.bind(sys.argv[1])
xpub = ctx.socket(zmq.XPUB); xpub.bind(sys.argv[2])
zmq.proxy(xsub, xpub)
"""


def dynamo_env(state_dir: Path, xsub: int, xpub: int) -> dict[str, str]:
    """Environment for Dynamo 1.6.1 on loopback: file discovery, TCP request plane, ZMQ events."""
    home, kv = state_dir / "home", state_dir / "kv"
    home.mkdir(parents=True, exist_ok=True)
    kv.mkdir(parents=True, exist_ok=True)
    env = {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(kv),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "DYN_ZMQ_BROKER_URL": f"xsub=tcp://127.0.0.1:{xsub} , xpub=tcp://127.0.0.1:{xpub}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HOME": str(home),  # model cards are cached under $HOME/.cache/dynamo
    }
    for var in (
        "DYN_HTTP_HOST",
        "DYN_TCP_RPC_HOST",
        "DYN_TCP_RESPONSE_STREAM_HOST",
        "DYN_EVENT_PLANE_HOST",
        "DYN_SYSTEM_HOST",
        "DYN_HTTP_RPC_HOST",
    ):
        env[var] = "127.0.0.1"
    return env


def start_dynamo(
    log_dir: Path,
    state_dir: Path,
    *,
    workers: int = 2,
    frontend_args: Sequence[str] = ("--router-mode", "kv", "--router-session-affinity-ttl-secs", "60"),
    timeout: float = 60.0,
) -> Stack:
    """ZMQ relay + ``workers`` mocker engines + the frontend; ready once the frontend lists
    every worker's ``generate`` instance and serves the model."""
    py = GATEWAYS_DIR / GATEWAYS["dynamo"][1]
    xsub, xpub, http_port = free_port(), free_port(), free_port()
    env = dynamo_env(state_dir, xsub, xpub)
    stack = Stack(f"http://127.0.0.1:{http_port}")
    try:
        relay = ManagedProcess(
            "zmq-relay",
            [py, "-c", _ZMQ_RELAY, f"tcp://127.0.0.1:{xsub}", f"tcp://127.0.0.1:{xpub}"],
            log_dir,
            env=env,
            term_grace=5,
        )
        stack.procs.append(relay)
        for i in range(1, workers + 1):
            stack.procs.append(
                ManagedProcess(
                    f"dynamo-mocker-{i}",
                    [
                        py,
                        "-m",
                        "dynamo.mocker",
                        "--model-path",
                        TINY_MODEL_DIR,
                        "--model-name",
                        MODEL,
                        "--speedup-ratio",
                        "10",
                    ],
                    log_dir,
                    env={**env, "DYN_SYSTEM_PORT": str(free_low_port())},
                    term_grace=10,
                )
            )
        stack.procs.append(
            ManagedProcess(
                "dynamo-frontend",
                [py, "-m", "dynamo.frontend", "--http-port", http_port, *frontend_args],
                log_dir,
                env=env,
                term_grace=10,
            )
        )

        def all_workers(body: Any) -> bool:
            ids = {i["instance_id"] for i in body.get("instances", []) if i.get("endpoint") == "generate"}
            return len(ids) >= workers

        def serves_model(body: Any) -> bool:
            return any(m.get("id") == MODEL for m in body.get("data", []))

        wait_ready(
            "dynamo",
            lambda: (
                _json_probe(f"{stack.url}/health", all_workers)()
                and _json_probe(f"{stack.url}/v1/models", serves_model)()
            ),
            stack.procs,
            timeout,
        )
    except BaseException:
        stack.stop()
        raise
    return stack


@dataclass
class Sidecar:
    url: str
    admin_url: str
    proc: ManagedProcess

    def stop(self) -> None:
        self.proc.stop()

    def metrics_text(self) -> str:
        got = http_get(f"{self.admin_url}/metrics")
        assert got is not None and got[0] == 200, f"sidecar GET /metrics failed: {got}"
        return got[1].decode()


def start_sidecar(
    upstream: str,
    mode: str,
    log_dir: Path,
    *,
    mode_opts: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 30.0,
) -> Sidecar:
    """``python -m sidecar run`` in front of ``upstream``; ready when admin ``/healthz`` is 200."""
    port, admin_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "sidecar",
        "run",
        "--listen",
        f"127.0.0.1:{port}",
        "--admin",
        f"127.0.0.1:{admin_port}",
        "--upstream",
        upstream,
        "--mode",
        mode,
    ]
    for key, value in (mode_opts or {}).items():
        argv += ["--mode-opt", f"{key}={value}"]
    argv += list(extra_args)
    proc = ManagedProcess(f"sidecar-{mode}", argv, log_dir, term_grace=10)
    sidecar = Sidecar(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", proc)
    try:
        wait_ready(f"sidecar ({mode})", _status_is(f"{sidecar.admin_url}/healthz"), [proc], timeout)
    except BaseException:
        proc.stop()
        raise
    return sidecar


# ---------------------------------------------------------------------------------------------
# Client traffic: multi-turn chat sessions
# ---------------------------------------------------------------------------------------------

# Which worker served a turn, from the response headers and the parsed JSON body (non-streaming)
# or SSE chunks (streaming).
WorkerOf = Callable[[Mapping[str, str], list[dict[str, Any]]], "str | None"]


def worker_from_header(name: str) -> WorkerOf:
    def worker_of(headers: Mapping[str, str], events: list[dict[str, Any]]) -> str | None:
        return headers.get(name)

    return worker_of


def dynamo_worker(headers: Mapping[str, str], events: list[dict[str, Any]]) -> str | None:
    """``nvext.worker_id.decode_worker_id`` (requires ``nvext.extra_fields: ["worker_id"]``);
    every chunk of one response must agree."""
    ids = {
        str(e["nvext"]["worker_id"]["decode_worker_id"])
        for e in events
        if isinstance(e.get("nvext"), dict) and "worker_id" in e["nvext"]
    }
    assert len(ids) <= 1, f"one response names several workers: {ids}"
    return ids.pop() if ids else None


DYNAMO_WORKER_ID_BODY = {"nvext": {"extra_fields": ["worker_id"]}}


@dataclass
class TurnResult:
    status: int
    worker: str | None
    headers: dict[str, str]
    text: str


@dataclass
class SessionResult:
    session_id: str
    turns: list[TurnResult] = field(default_factory=list)

    @property
    def workers(self) -> list[str | None]:
        return [t.worker for t in self.turns]

    @property
    def switches(self) -> int:
        w = self.workers
        return sum(1 for a, b in zip(w, w[1:]) if a != b)


def new_session_ids(n: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(n)]


async def _one_turn(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict[str, Any], worker_of: WorkerOf
) -> TurnResult:
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        resp_headers = {k.lower(): v for k, v in resp.headers.items()}
        events: list[dict[str, Any]] = []
        text = ""
        if resp.status != 200:
            text = (await resp.read()).decode(errors="replace")
        elif body.get("stream"):
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data:") :])
                events.append(event)
                for choice in event.get("choices", []):
                    text += (choice.get("delta") or {}).get("content") or ""
        else:
            event = await resp.json()
            events.append(event)
            text = event["choices"][0]["message"]["content"] or ""
        worker = worker_of(resp_headers, events) if resp.status == 200 else None
        return TurnResult(resp.status, worker, resp_headers, text)


async def run_sessions(
    url: str,
    session_ids: Sequence[str],
    *,
    turns: int,
    worker_of: WorkerOf,
    concurrency: int = 4,
    stream: bool = True,
    session_headers: Callable[[str, int, bool], dict[str, str]] | None = None,
    body_extra: Mapping[str, Any] | None = None,
    max_tokens: int = 8,
) -> dict[str, SessionResult]:
    """Multi-turn conversations, AIPerf-style: each session's turns run in order (the history
    grows), up to ``concurrency`` sessions at once. Every request carries a fresh
    ``X-Request-ID``; ``session_headers(session_id, turn_index, is_last_turn)`` adds the
    session's own headers (default: ``X-Correlation-ID: <session id>``)."""
    if session_headers is None:

        def session_headers(sid: str, turn: int, last: bool) -> dict[str, str]:
            return {"X-Correlation-ID": sid}

    results = {sid: SessionResult(sid) for sid in session_ids}
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=30)

    async def conversation(http: aiohttp.ClientSession, sid: str) -> None:
        messages: list[dict[str, str]] = []
        async with gate:
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Session {sid[:16]} turn {turn}: go on."})
                body = {
                    "model": MODEL,
                    "messages": list(messages),
                    "stream": stream,
                    "max_tokens": max_tokens,
                    **(body_extra or {}),
                }
                headers = {"X-Request-ID": str(uuid.uuid4()), **session_headers(sid, turn, turn == turns - 1)}
                result = await _one_turn(http, url, headers, body, worker_of)
                results[sid].turns.append(result)
                if result.status != 200:
                    return
                messages.append({"role": "assistant", "content": result.text})

    async with aiohttp.ClientSession(timeout=timeout) as http:
        await asyncio.gather(*(conversation(http, sid) for sid in session_ids))
    return results


def failed_turns(results: Mapping[str, SessionResult]) -> list[str]:
    return [
        f"{sid} turn {i}: HTTP {t.status} {t.text[:300]}"
        for sid, r in results.items()
        for i, t in enumerate(r.turns)
        if t.status != 200
    ]


def summarize(results: Mapping[str, SessionResult]) -> dict[str, int]:
    """Counts for a report: sessions, sessions served by more than one worker, worker switches,
    distinct workers used."""
    return {
        "sessions": len(results),
        "moved": sum(1 for r in results.values() if len(set(r.workers)) > 1),
        "switches": sum(r.switches for r in results.values()),
        "workers_used": len({w for r in results.values() for w in r.workers}),
    }


def header_values_by_session(
    workers: Iterable[MockWorker],
    header: str,
    *,
    session_header: str = "x-correlation-id",
    path: str = "/v1/chat/completions",
) -> dict[str, set[str | None]]:
    """For each session (by ``session_header`` as the workers received it), the set of values of
    ``header`` on the chat requests that reached any worker (None where it was absent)."""
    seen: dict[str, set[str | None]] = {}
    for worker in workers:
        for req in worker.received():
            if req["path"] != path:
                continue
            sid = req["headers"].get(session_header)
            if sid is not None:
                seen.setdefault(sid, set()).add(req["headers"].get(header))
    return seen
