"""The store's URL as the commands show and check it: its password masked everywhere it is shown
(`check-config`, errors, the start-up log, `/metrics`), and a URL the store client would choke
on (a query option it does not know, or a value it cannot read) refused before anything starts."""

from __future__ import annotations

import signal
import subprocess
import sys

import aiohttp
import orjson
import pytest
import yaml

from tests.config.test_early import UP, check_config, clean_env
from tests.proxy.test_errors import free_ports
from tests.state.conftest import RedisServer
from tests.test_cli import spawn, stop, wait_healthy

SECRET = "s3cret-Store-Pa55"


def test_check_config_masks_the_store_password():
    result = check_config(env=clean_env(SIDECAR_UPSTREAM=UP, SIDECAR_STATE=f"redis://:{SECRET}@store:6379/2"))
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["state"]["url"] == "redis://:***@store:6379/2"
    assert SECRET not in result.stdout
    result = check_config(env=clean_env(SIDECAR_UPSTREAM=UP, SIDECAR_STATE=f"rediss://fleet:{SECRET}@store:6380"))
    assert yaml.safe_load(result.stdout)["state"]["url"] == "rediss://fleet:***@store:6380"


@pytest.mark.parametrize(
    "url, problem",
    [
        (f"redis://:{SECRET}@store:port/0", "not a URL (Invalid URL: port can't be converted to integer)"),
        (f"redis://:{SECRET}@st ore:6379/0", "a redis:// or rediss:// URL needs a host name or an IP address"),
        (f"redis://:{SECRET}@store:6379/zero", "the path is the database number, e.g. redis://HOST:PORT/0"),
        (f"ftp://:{SECRET}@store:6379/0", "must be memory://, redis://HOST:PORT[/DB]"),
    ],
)
def test_a_malformed_store_url_is_refused_without_its_password(url, problem):
    result = check_config(env=clean_env(SIDECAR_UPSTREAM=UP, SIDECAR_STATE=url))
    assert result.returncode == 2
    assert f"state.url: {problem}" in result.stderr
    assert SECRET not in result.stderr


UNSUPPORTED = "is not supported: the only one is db (the database number); timeouts come from state.timeout_ms"


@pytest.mark.parametrize(
    "query, problem",
    [
        ("?foo=1", f"query option 'foo' {UNSUPPORTED}"),
        ("?socket_timeout=abc", f"query option 'socket_timeout' {UNSUPPORTED}"),
        ("?db=1&retry_on_timeout=yes", f"query option 'retry_on_timeout' {UNSUPPORTED}"),
        ("?db=one", "query option 'db' must be a database number >= 0 (got 'one')"),
    ],
)
def test_a_store_url_query_is_checked_by_check_config_and_run_alike(query, problem):
    url = f"redis://:{SECRET}@127.0.0.1:1{query}"
    expected = f"sidecar: invalid configuration:\nstate.url: {problem}"
    result = check_config(env=clean_env(SIDECAR_UPSTREAM=UP, SIDECAR_STATE=url))
    assert result.returncode == 2 and result.stderr.startswith(expected), result.stderr
    port, admin_port = free_ports(2)
    run = subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin_port}"]
        + ["--upstream", UP, "--state", url],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert run.returncode == 2 and run.stderr == result.stderr
    assert "Traceback" not in run.stderr and SECRET not in run.stderr


async def test_run_with_a_password_in_the_url_logs_and_exports_it_masked(redis_server: RedisServer, upstream):
    """The store is reached with the URL's password and database (?db=), and neither the log
    nor /metrics shows the password."""
    redis_server.cli("CONFIG", "SET", "requirepass", SECRET)
    url = f"redis://:{SECRET}@127.0.0.1:{redis_server.port}?db=3"
    port, admin_port = free_ports(2)
    proc = spawn(
        "--listen",
        f"127.0.0.1:{port}",
        "--admin",
        f"127.0.0.1:{admin_port}",
        "--upstream",
        upstream.url,
        "--state",
        url,
        env={**clean_env(), "SIDECAR_SHUTDOWN_DELAY_SECONDS": "0", "SIDECAR_LOG_LEVEL": "debug"},
    )
    try:
        await wait_healthy(f"http://127.0.0.1:{admin_port}", proc)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/x", headers={"X-Correlation-ID": "masked-1"}) as resp:
                assert resp.status == 200
            async with s.get(f"http://127.0.0.1:{admin_port}/metrics") as resp:
                metrics = await resp.text()
        assert "sidecar_state_store_up 1.0" in metrics  # the password was used: the store answered
        assert SECRET not in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        log = proc.stderr.read() if proc.stderr else ""
    finally:
        stop(proc)
    assert SECRET not in log
    (started,) = [orjson.loads(line) for line in log.splitlines() if '"sidecar started"' in line]
    assert started["state"] == f"redis://:***@127.0.0.1:{redis_server.port}?db=3"
    assert "sidecar:" in redis_server.cli("-a", SECRET, "--no-auth-warning", "-n", "3", "--scan")
    assert redis_server.cli("-a", SECRET, "--no-auth-warning", "-n", "0", "--scan").strip() == ""
