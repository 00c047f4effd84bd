"""SIDECAR_* environment variables as `sidecar check-config` and `sidecar run` read them: a typo
is an error naming the nearest valid name; every variable the product (or Kubernetes, for a
Service named `sidecar-...`) legitimately sets is accepted."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from sidecar.config import OUTSIDE_CONFIG_ENV, TOOLING_ENV, config_env_names
from tests.config.test_early import UP, clean_env


def sidecar(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True, text=True, timeout=30, env=env)


def test_a_misspelled_variable_is_an_error_naming_the_one_meant():
    result = sidecar("check-config", env=clean_env(SIDECAR_UPSTREM="http://x:1"))
    assert result.returncode == 2
    assert "SIDECAR_UPSTREM: unknown environment variable; did you mean SIDECAR_UPSTREAM?" in result.stderr
    assert "upstream: required" in result.stderr  # reported with the rest, at once


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "SIDECAR_SESSIONS_IDLE_TTL_SECONDS",
            "SIDECAR_SESSIONS_IDLE_TTL_SECONDS: unknown environment variable; sessions.idle_ttl_seconds has no "
            "variable: set it in the configuration file (--config / SIDECAR_CONFIG)",
        ),
        (
            "SIDECAR_TIMEOUTS_CONECT",
            "SIDECAR_TIMEOUTS_CONECT: unknown environment variable; did you mean the setting timeouts.connect? It "
            "has no variable: set it in the configuration file (--config / SIDECAR_CONFIG)",
        ),
        ("SIDECAR_LOGLEVEL", "SIDECAR_LOGLEVEL: unknown environment variable; did you mean SIDECAR_LOG_LEVEL?"),
        ("SIDECAR_WHATEVER", "SIDECAR_WHATEVER: unknown environment variable"),
    ],
)
def test_a_variable_of_no_setting_is_an_error(name, expected):
    result = sidecar("check-config", env=clean_env(SIDECAR_UPSTREAM=UP, **{name: "5"}))
    assert result.returncode == 2
    assert result.stderr.splitlines()[1:] == [expected]


def test_run_refuses_to_start_with_a_misspelled_variable():
    env = clean_env(SIDECAR_UPSTREAM=UP, SIDECAR_LISTEN="127.0.0.1:0", SIDECAR_ADMIN="127.0.0.1:0")
    result = sidecar("run", env={**env, "SIDECAR_SHUTDOWN_DELAY_SECOND": "0"})
    assert result.returncode == 2
    assert result.stderr == (
        "sidecar: invalid configuration:\n"
        "SIDECAR_SHUTDOWN_DELAY_SECOND: unknown environment variable; did you mean SIDECAR_SHUTDOWN_DELAY_SECONDS?\n"
    )


# A valid value of each variable that sets a setting (every one must be listed here).
SETTING_VALUES = {
    "SIDECAR_LISTEN": "127.0.0.1:18084",
    "SIDECAR_ADMIN": "127.0.0.1:19091",
    "SIDECAR_UPSTREAM": UP,
    "SIDECAR_MODE": "session_id_header",
    "SIDECAR_MODE_OPTS": "header_name=X-Conv",
    "SIDECAR_ENGINE": "aiohttp",
    "SIDECAR_LOG_LEVEL": "warning",
    "SIDECAR_DRAIN_GRACE_SECONDS": "3",
    "SIDECAR_SHUTDOWN_DELAY_SECONDS": "0",
    "SIDECAR_HEAD_TIMEOUT_SECONDS": "9",
    "SIDECAR_ADMIN_INSECURE": "false",
    "SIDECAR_IDLE_POLL_US": "0",
    "SIDECAR_STATE": "memory://",
}


def test_every_variable_the_sidecar_reads_is_accepted(tmp_path):
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(yaml.safe_dump({"tokens": [{"token": "f" * 32, "admin": True}]}))
    config = tmp_path / "config.yaml"
    config.write_text("readiness_check_upstream: false\n")
    values = {
        **SETTING_VALUES,
        "SIDECAR_ADMIN_TOKENS_FILE": str(tokens),
        "SIDECAR_CONFIG": str(config),
        "SIDECAR_STATE_PASSWORD": "unused-with-memory",
        "SIDECAR_REQUIRE_COMPILED": "1",
        # Read by the repository's scripts and tests only: the sidecar ignores them.
        **{name: "/tmp/x" for name in TOOLING_ENV},
    }
    assert set(config_env_names()) | set(OUTSIDE_CONFIG_ENV) | set(TOOLING_ENV) == set(values) | {
        "SIDECAR_PURE_PYTHON"  # kept as the test run has it: it picks the build, not a setting
    }
    result = sidecar("check-config", env=clean_env(**values))
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert (shown["listen"], shown["engine"], shown["readiness_check_upstream"]) == (
        "127.0.0.1:18084",
        "aiohttp",
        False,
    )
    assert shown["deployments"][0]["mode_options"]["header_name"] == "X-Conv"


def test_the_variables_kubernetes_sets_for_a_sidecar_service_are_accepted():
    """`helm install sidecar ...` makes a Service `sidecar-session-sidecar`: with service links on
    (the default) every pod of the namespace gets these."""
    links = {
        "SIDECAR_SESSION_SIDECAR_SERVICE_HOST": "10.96.4.12",
        "SIDECAR_SESSION_SIDECAR_SERVICE_PORT": "8080",
        "SIDECAR_SESSION_SIDECAR_SERVICE_PORT_HTTP": "8080",
        "SIDECAR_SESSION_SIDECAR_PORT": "tcp://10.96.4.12:8080",
        "SIDECAR_SESSION_SIDECAR_PORT_8080_TCP": "tcp://10.96.4.12:8080",
        "SIDECAR_SESSION_SIDECAR_PORT_8080_TCP_PROTO": "tcp",
        "SIDECAR_SESSION_SIDECAR_PORT_8080_TCP_PORT": "8080",
        "SIDECAR_SESSION_SIDECAR_PORT_8080_TCP_ADDR": "10.96.4.12",
        "SIDECAR_SERVICE_HOST": "fd00::12",
        "SIDECAR_PORT": "tcp://[fd00::12]:8080",
    }
    result = sidecar("check-config", env=clean_env(SIDECAR_UPSTREAM=UP, **links))
    assert result.returncode == 0, result.stderr
    # The same names with values no Service has are typos like any other.
    result = sidecar("check-config", env=clean_env(SIDECAR_UPSTREAM=UP, SIDECAR_PORT="8080"))
    assert result.returncode == 2 and "SIDECAR_PORT: unknown environment variable" in result.stderr
