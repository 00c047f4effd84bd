"""The `sidecar` command as users run it: a real process, signals, the README example."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

import sidecar
from tests.proxy.test_errors import free_ports


async def wait_healthy(admin: str, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                async with s.get(f"{admin}/healthz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("sidecar did not become healthy")


def spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sidecar", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
        text=True,
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    for stream in (proc.stdout, proc.stderr):
        if stream:
            stream.close()


async def test_readme_example_command_and_sigterm_drain(upstream):
    port, admin_port = free_ports(2)
    # No shutdown delay: this checks the drain itself (tests/test_rollout.py covers the delay).
    proc = spawn(
        "--listen",
        f"127.0.0.1:{port}",
        "--upstream",
        upstream.url,
        "--mode",
        "dynamo_headers",
        "--admin",
        f"127.0.0.1:{admin_port}",
        env={"SIDECAR_DRAIN_GRACE_SECONDS": "5", "SIDECAR_SHUTDOWN_DELAY_SECONDS": "0"},
    )
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        await wait_healthy(admin, proc)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{admin}/readyz") as resp:
                assert resp.status in (200, 503)
            # A stream is in flight when SIGTERM arrives: it must finish, new connections refused.
            async with s.get(
                f"http://127.0.0.1:{port}/sse?chunks=6&gap=0.15", headers={"X-Correlation-ID": "drain-me"}
            ) as resp:
                first = await resp.content.readuntil(b"\n\n")
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                try:
                    async with aiohttp.ClientSession() as s2:
                        async with s2.get(f"http://127.0.0.1:{port}/x") as r2:
                            refused = False
                            await r2.read()
                except aiohttp.ClientConnectionError:
                    refused = True
                rest = await resp.read()
        assert first == b'data: {"i":0}\n\n'
        assert rest.endswith(b"data: [DONE]\n\n") and rest.count(b"data: ") == 6
        assert refused, "a new connection was accepted during the drain"
        assert proc.wait(10) == 0
        assert upstream.received[0].all("X-Dynamo-Session-ID") == ["drain-me"]
        logs = proc.stderr.read() if proc.stderr else ""
        assert '"msg":"sidecar stopped"' in logs
    finally:
        stop(proc)


def test_invalid_flag_value_refuses_to_start():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "run",
            "--upstream",
            "http://127.0.0.1:1",
            "--mode",
            "dynamo_headers",
            "--mode-opt",
            "timeout_secs=5",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "mode_options.timeout_secs: unknown setting" in proc.stderr


def test_env_only_configuration_refuses_bad_listen():
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar", "run"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "SIDECAR_UPSTREAM": "http://127.0.0.1:1", "SIDECAR_LISTEN": "8080"},
    )
    assert proc.returncode == 2
    assert "listen: must be HOST:PORT, e.g. 0.0.0.0:8080 (got '8080')\n" in proc.stderr


@pytest.mark.parametrize("taken", ["listen", "admin"])
def test_a_listener_that_cannot_bind_is_one_clear_line(taken):
    """Nothing about a shutdown that never was ("0 end-of-session actions not sent") comes
    before, or after, the reason."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        port, admin_port = free_ports(2)
        ports = {"listen": port, "admin": admin_port, taken: busy}
        proc = subprocess.run(
            [sys.executable, "-m", "sidecar", "run", "--upstream", "http://127.0.0.1:1"]
            + ["--listen", f"127.0.0.1:{ports['listen']}", "--admin", f"127.0.0.1:{ports['admin']}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if "open file limit" not in line]
    assert lines == [
        f"sidecar: cannot start: error while attempting to bind on address ('127.0.0.1', {busy}): address already "
        f"in use (listen 127.0.0.1:{ports['listen']}, admin 127.0.0.1:{ports['admin']})"
    ]


def test_modes_lists_every_mode_with_options():
    out = subprocess.run([sys.executable, "-m", "sidecar", "modes"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    assert out.stdout.startswith("dynamo_headers") or "\ndynamo_headers" in out.stdout
    assert "options: none" in out.stdout


@pytest.mark.parametrize("pure", ["1", "0"], ids=["pure-python", "as-installed"])
def test_modules_with_compiled_layouts_load_as_one_build(pure):
    """Every module with a .pxd layout (the request path: engine, router, lineage, metrics, ...)
    loads from the same build as the fast engine, and SIDECAR_PURE_PYTHON=1 covers all of them."""
    package = Path(sidecar.__file__).parent
    modules = sorted(
        "sidecar." + ".".join(p.relative_to(package).with_suffix("").parts)
        for p in package.rglob("*.pxd")
        if p.with_suffix(".py").exists()  # (not the declarations of a compiled-only .pyx)
    )
    assert "sidecar.router" in modules and "sidecar.engine.fast" in modules
    code = "import importlib, sys; print('\\n'.join(importlib.import_module(m).__file__ for m in sys.argv[1:]))"
    files = subprocess.run(
        [sys.executable, "-c", code, *modules],
        env={**os.environ, "SIDECAR_PURE_PYTHON": pure},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    assert len(files) == len(modules)
    compiled = [f for f in files if not f.endswith(".py")]
    if pure == "1":
        assert not compiled, compiled
    else:
        assert len(compiled) in (0, len(files)), files  # one build: all compiled, or none


@pytest.mark.parametrize("pure", ["1", "0"], ids=["pure-python", "as-installed"])
async def test_startup_log_says_whether_the_fast_engine_runs_compiled(upstream, pure):
    """SIDECAR_PURE_PYTHON=1 runs the .py sources even where compiled modules are installed; the
    startup log line says which build serves (it must match the module actually loaded)."""
    env = {"SIDECAR_PURE_PYTHON": pure, "SIDECAR_SHUTDOWN_DELAY_SECONDS": "0"}
    loaded = subprocess.run(
        [sys.executable, "-c", "import sidecar.engine.fast as f; print(f.__file__)"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.strip()
    if pure == "1":
        assert loaded.endswith(os.path.join("engine", "fast.py")), loaded
    port, admin_port = free_ports(2)
    proc = spawn(
        "--listen",
        f"127.0.0.1:{port}",
        "--upstream",
        upstream.url,
        "--mode",
        "dynamo_headers",
        "--admin",
        f"127.0.0.1:{admin_port}",
        "--engine",
        "fast",
        env=env,
    )
    try:
        await wait_healthy(f"http://127.0.0.1:{admin_port}", proc)
        async with aiohttp.ClientSession() as s:
            async with s.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                data=b"{}",
                headers={"X-Correlation-ID": f"build-{pure}"},
            ) as resp:
                assert resp.status == 200
        assert upstream.received[-1].all("X-Dynamo-Session-ID") == [f"build-{pure}"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        lines = [
            orjson.loads(line)
            for line in (proc.stderr.read() if proc.stderr else "").splitlines()
            if '"sidecar started"' in line
        ]
        assert len(lines) == 1 and lines[0]["engine"] == "fast"
        assert lines[0]["compiled"] is (not loaded.endswith(".py"))
    finally:
        stop(proc)


async def test_a_low_soft_open_file_limit_is_raised_to_the_hard_limit_at_start(upstream):
    """Started with a soft limit of 256 under a higher hard limit (as many environments start
    processes at 1024), the sidecar raises its soft limit to the hard one and says so."""
    import resource

    from sidecar.fdlimit import CEILING

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = CEILING if hard == resource.RLIM_INFINITY or hard > CEILING else hard
    if want <= 256:
        pytest.skip("the hard open file limit is too low to raise anything")
    port, admin_port = free_ports(2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "run", "--listen", f"127.0.0.1:{port}", "--upstream", upstream.url]
        + ["--admin", f"127.0.0.1:{admin_port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)),
    )
    try:
        await wait_healthy(f"http://127.0.0.1:{admin_port}", proc)
        limits = Path(f"/proc/{proc.pid}/limits").read_text().splitlines()
        (line,) = [x for x in limits if x.startswith("Max open files")]
        assert line.split()[3:5] == [str(want), "unlimited" if hard == resource.RLIM_INFINITY else str(hard)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        logs = [orjson.loads(x) for x in (proc.stderr.read() if proc.stderr else "").splitlines() if x.startswith("{")]
        assert [x["msg"] for x in logs if "open file limit" in x["msg"]] == [
            f"open file limit raised from 256 to {want}"
        ]
    finally:
        stop(proc)
