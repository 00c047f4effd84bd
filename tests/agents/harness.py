"""Running the real agent clients headless, on loopback only, in front of the sidecar.

Each client (:data:`CLIENTS`) is installed by ``scripts/install_agents.sh`` under
``$SIDECAR_AGENTS_DIR`` (default ``<repo>/.agents``) and runs one prompt that makes the scripted
endpoint (:mod:`tests.agents.scripted_llm`) drive main agent -> sub-agent -> nested sub-agent.
:func:`run_client` gives it a fresh temporary HOME and configuration (every networked feature
off), and runs it through :mod:`tests.agents.isolated`: in a network namespace of its own when
the machine allows one (nothing but loopback there), always under ``strace``. Its only way out
is a Unix socket, where the test's end relays each connection to the sidecar
(:func:`byte_relay`), or splits requests between two sidecars by header (:class:`Splitter`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tests.agents.isolated import is_loopback, pipe, tried_addresses
from tests.agents.scripted_llm import task

REPO_ROOT = Path(__file__).resolve().parents[2]
AGENTS_DIR = Path(os.environ.get("SIDECAR_AGENTS_DIR") or REPO_ROOT / ".agents")
INSTALL_COMMAND = "scripts/install_agents.sh"
MODULES = AGENTS_DIR / "node_modules"
PROMPT = task(0)
# How long one client run may take (each makes about seven requests).
RUN_TIMEOUT = 240.0


@dataclass(frozen=True)
class Client:
    name: str
    version: str
    package: str  # the npm package (its package.json names the version installed)
    binary: Path
    api: str  # the path its requests take

    def installed_version(self) -> str | None:
        try:
            return str(json.loads((MODULES / self.package / "package.json").read_text())["version"])
        except (OSError, ValueError, KeyError):
            return None


CLIENTS = {
    "claude_code": Client(
        "claude_code",
        "2.1.197",
        "@anthropic-ai/claude-code",
        MODULES / "@anthropic-ai" / "claude-code" / "bin" / "claude.exe",
        "/v1/messages",
    ),
    "codex": Client(
        "codex",
        "0.171.0",
        "@openai/codex",
        MODULES / "@openai" / "codex-linux-x64" / "vendor" / "x86_64-unknown-linux-musl" / "bin" / "codex",
        "/v1/responses",
    ),
    "opencode": Client(
        "opencode",
        "1.18.33",
        "opencode-ai",
        MODULES / "opencode-linux-x64" / "bin" / "opencode",
        "/v1/chat/completions",
    ),
}


def missing(client: Client) -> str | None:
    """Why ``client`` cannot run here (None when it can)."""
    if shutil.which("node") is None:
        return "Node.js is not installed (the agent clients need it; CI has it)"
    if shutil.which("strace") is None:
        return "strace is not installed (it records what each client tries to reach)"
    if client.installed_version() != client.version or not client.binary.exists():
        return f"{client.package} {client.version} is not installed in {AGENTS_DIR}; run {INSTALL_COMMAND}"
    return None


@functools.cache
def netns_available() -> bool:
    """Whether this process may run a child in a network namespace of its own (``unshare -n``)."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Run:
    """One client run: its status and output, and what it tried to reach."""

    client: Client
    status: int
    stdout: str
    stderr: str
    tried: list[str]
    netns: bool
    reached_proxy: bool = False

    def describe(self) -> str:
        return f"{self.client.name} exited {self.status}\nstdout: {self.stdout[-2000:]}\nstderr: {self.stderr[-4000:]}"

    @property
    def elsewhere(self) -> list[str]:
        """The non-loopback addresses it tried."""
        return sorted({a for a in self.tried if not is_loopback(a)})


def _env(home: Path) -> dict[str, str]:
    """A client's whole environment: nothing of this process's but PATH (no credentials)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "PYTHONPATH": str(REPO_ROOT),
    }
    return env


def _prepare(client: Client, base: str, work: Path) -> tuple[list[str], dict[str, str]]:
    """The client's command line and environment, its configuration written under ``work``."""
    home = work / "home"
    home.mkdir(parents=True)
    env = _env(home)
    if client.name == "claude_code":
        env.update(
            ANTHROPIC_BASE_URL=base,
            ANTHROPIC_API_KEY="dummy",
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            DISABLE_TELEMETRY="1",
            DISABLE_AUTOUPDATER="1",
            DISABLE_ERROR_REPORTING="1",
        )
        return [str(client.binary), "-p", PROMPT, "--output-format", "text"], env
    if client.name == "codex":
        codex_home = work / "codex"
        codex_home.mkdir()
        off = [
            "plugins",
            "apps",
            "remote_plugin",
            "plugin_sharing",
            "tool_suggest",
            "api_key_model_discovery",
            "skill_mcp_dependency_install",
            "browser_use",
            "computer_use",
            "image_generation",
            "in_app_updates",
            "daemon_auto_start",
        ]
        features = "\n".join(f"{name} = false" for name in off)
        (codex_home / "config.toml").write_text(
            f"""model = "mock-model"
model_provider = "mock"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[model_providers.mock]
name = "mock"
base_url = "{base}/v1"
wire_api = "responses"
env_key = "MOCK_API_KEY"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[otel]
exporter = "none"

[features]
multi_agent = true
{features}

[agents]
max_depth = 2
"""
        )
        env.update(CODEX_HOME=str(codex_home), MOCK_API_KEY="dummy")
        return [str(client.binary), "exec", "--skip-git-repo-check", PROMPT], env
    config = {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "permission": {"*": "allow"},
        "provider": {
            "mock": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "mock",
                "options": {"baseURL": f"{base}/v1", "apiKey": "dummy"},
                "models": {"mock-model": {"name": "mock-model"}},
            }
        },
        "agent": {"general": {"permission": {"task": "allow"}}},
        "subagent_depth": 2,
    }
    path = work / "opencode.json"
    path.write_text(json.dumps(config))
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: package lookups fail at once
    env.update(
        OPENCODE_CONFIG=str(path),
        OPENCODE_DISABLE_AUTOUPDATE="1",
        OPENCODE_DISABLE_MODELS_FETCH="1",
        OPENCODE_DISABLE_LSP_DOWNLOAD="1",
        OPENCODE_DISABLE_SHARE="1",
        OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
        NPM_CONFIG_REGISTRY=closed,
        BUN_CONFIG_REGISTRY=closed,
    )
    return [str(client.binary), "run", "--model", "mock/mock-model", PROMPT], env


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def run_client(client: Client, handler: Handler | None = None, *, unix_site: Any = None) -> Run:
    """Run ``client`` once: its only way out is a Unix socket served by ``handler`` (a stream
    handler), or by ``unix_site(path)`` (an async callable that starts a server on ``path`` and
    returns something with ``stop()``)."""
    work = Path(tempfile.mkdtemp(prefix="agent-"))
    try:
        port = free_port()
        path = str(work / "out.sock")
        if handler is not None:
            server: Any = await asyncio.start_unix_server(handler, path)
        else:
            server = await unix_site(path)
        argv, env = _prepare(client, f"http://127.0.0.1:{port}", work)
        trace = work / "trace.log"
        netns = netns_available()
        runner = [sys.executable, "-m", "tests.agents.isolated", "--port", str(port), "--socket", path]
        runner += ["--trace", str(trace), "--cwd", str(work)]
        if netns:
            runner = [shutil.which("unshare") or "unshare", "-n", *runner, "--netns"]
        proc = await asyncio.create_subprocess_exec(
            *runner,
            "--",
            *argv,
            cwd=str(REPO_ROOT),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT)
        except TimeoutError:
            proc.kill()
            out, err = await proc.communicate()
        finally:
            if handler is not None:
                server.close()
                await server.wait_closed()
            else:
                await server.stop()
        tried = tried_addresses(trace) if trace.exists() else []
        return Run(
            client,
            proc.returncode if proc.returncode is not None else -1,
            out.decode(errors="replace"),
            err.decode(errors="replace"),
            tried,
            netns,
            reached_proxy=f"htons({port})" in (trace.read_text(errors="replace") if trace.exists() else ""),
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def byte_relay(host: str, port: int) -> Handler:
    """A stream handler that relays each connection, byte for byte, to ``host:port``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    return handle


# Request headers by which these clients mark a sub-agent's request.
SUB_AGENT_HEADERS = ("x-claude-code-agent-id", "x-codex-parent-thread-id", "x-parent-session-id")
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-connection", "host", "content-length"}


@dataclass
class Splitter:
    """An HTTP proxy on a Unix socket that sends each request to replica ``a``, or to ``b`` when
    it is a sub-agent's (one of :data:`SUB_AGENT_HEADERS`), streaming the answers back; it
    decides nothing else and records where each request went."""

    a: str
    b: str
    went: list[str] = field(default_factory=list)
    _runner: web.AppRunner | None = None
    _http: aiohttp.ClientSession | None = None

    async def start(self, path: str) -> Splitter:
        self._http = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.UnixSite(self._runner, path).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        sub = any(request.headers.get(name, "").strip() for name in SUB_AGENT_HEADERS)
        self.went.append("b" if sub else "a")
        target = self.b if sub else self.a
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        assert self._http is not None
        body = await request.read()
        async with self._http.request(
            request.method, target + request.path_qs, headers=headers, data=body or None, allow_redirects=False
        ) as upstream:
            resp = web.StreamResponse(status=upstream.status)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP:
                    resp.headers.add(k, v)
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
