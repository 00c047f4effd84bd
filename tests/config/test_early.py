"""Configuration that fails early and says so clearly: each bad value quoted once, the expected
form of an address, YAML errors with file and line, placeholder admin tokens refused, and a
`check-config` that shows the configuration a pod would run with (file and SIDECAR_* env)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import sidecar
from sidecar.auth import PLACEHOLDER, load_tokens
from sidecar.config import build_config
from sidecar.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CHART_HELPERS = ROOT / "deploy" / "helm" / "session-sidecar" / "templates" / "_helpers.tpl"
UP = "http://127.0.0.1:18000"


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


def error(**kw) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as exc:
        build_config(**{"env": {}, **kw})
    return str(exc.value)


@pytest.mark.parametrize(
    "env, expected",
    [
        (
            {"SIDECAR_UPSTREAM": UP, "SIDECAR_LISTEN": "8080"},
            "listen: must be HOST:PORT, e.g. 0.0.0.0:8080 (got '8080')",
        ),
        (
            {"SIDECAR_UPSTREAM": "ftp://gw:1"},
            "upstream: must be an http:// or https:// URL with a host (got 'ftp://gw:1')",
        ),
        (
            {"SIDECAR_UPSTREAM": "http://gw:1/?a=b"},
            "upstream: must not carry a query or fragment (got 'http://gw:1/?a=b')",
        ),
        (
            {"SIDECAR_UPSTREAM": UP, "SIDECAR_SHUTDOWN_DELAY_SECONDS": "-1"},
            "shutdown_delay_seconds: Input should be greater than or equal to 0 (got '-1')",
        ),
    ],
)
def test_each_bad_value_is_quoted_once(env, expected):
    assert error(env=env) == expected


def test_values_in_files_are_quoted_once_too(tmp_path):
    text = f"upstream: {UP}\nlisten: 8080\ndeployment_header: 'bad name'\n"
    assert error(file=write(tmp_path, text)).splitlines() == [
        "listen: must be HOST:PORT, e.g. 0.0.0.0:8080 (got 8080)",
        "deployment_header: 'bad name' is not a valid header name (RFC 9110 token)",
    ]
    text = "deployments:\n  - name: a\n    upstreams: [nope]\n"
    assert (
        error(file=write(tmp_path, text))
        == "deployments[0].upstreams[0]: must be an http:// or https:// URL with a host (got 'nope')"
    )
    # A listen address in its structured form is still accepted.
    cfg = build_config(env={}, file=write(tmp_path, f"upstream: {UP}\nadmin: {{host: 127.0.0.1, port: 9999}}\n"))
    assert str(cfg.admin) == "127.0.0.1:9999"


def test_yaml_errors_name_the_file_and_the_line(tmp_path):
    f = write(tmp_path, f"upstream: {UP}\nmode: dynamo_headers\n  timeouts: {{connect: 5}}\n")
    message = error(file=f)
    assert message.startswith(f"config file {f}, line 3, column ")
    assert "invalid YAML: mapping values are not allowed here" in message
    assert "\n" not in message  # no quoted excerpt of the file (it could hold a secret)


def test_shutdown_delay_setting(tmp_path):
    assert build_config(flags={"upstream": UP}, env={}).shutdown_delay_seconds == 5.0
    assert build_config(flags={"upstream": UP}, env={"SIDECAR_SHUTDOWN_DELAY_SECONDS": "0"}).shutdown_delay_seconds == 0
    cfg = build_config(
        env={"SIDECAR_SHUTDOWN_DELAY_SECONDS": "2.5"},
        file=write(tmp_path, f"upstream: {UP}\nshutdown_delay_seconds: 9\n"),
    )
    assert cfg.shutdown_delay_seconds == 2.5  # the environment over the file


# -- check-config ---------------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without SIDECAR_* settings (the build switch stays)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_") or k == "SIDECAR_PURE_PYTHON"}
    return {**env, **extra}


def check_config(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "check-config", *args], capture_output=True, text=True, timeout=30, env=env
    )


def test_check_config_shows_the_configuration_in_effect(tmp_path):
    f = write(tmp_path, f"upstream: {UP}\nmode: dynamo_headers\nshutdown_delay_seconds: 9\n")
    # As in a pod: the file named by SIDECAR_CONFIG, settings from the environment on top.
    result = check_config(
        env=clean_env(SIDECAR_CONFIG=str(f), SIDECAR_SHUTDOWN_DELAY_SECONDS="3", SIDECAR_LISTEN="0.0.0.0:8080")
    )
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert (shown["shutdown_delay_seconds"], shown["listen"]) == (3.0, "0.0.0.0:8080")
    assert shown["deployments"][0]["upstreams"] == [UP] and shown["deployments"][0]["mode"] == "dynamo_headers"
    # A file given on the command line, the environment still on top.
    result = check_config(str(f), env=clean_env(SIDECAR_MODE="smg_routing_key"))
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["deployments"][0]["mode"] == "smg_routing_key"
    # No file at all: the environment alone is a complete configuration.
    result = check_config(env=clean_env(SIDECAR_UPSTREAM=UP))
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["deployments"][0]["upstreams"] == [UP]


def test_every_problem_is_reported_at_once(tmp_path):
    """A mode's options are checked in the same pass as the other settings, and so are the files
    the configuration names: one run shows everything to fix."""
    f = write(tmp_path, f"upstream: {UP}\nlisten: 8080\ntimeouts: {{connect: 0}}\nmode: smg_routing_key\n")
    result = check_config(str(f), env=clean_env(SIDECAR_MODE_OPTS="scope=forest"))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "sidecar: invalid configuration:",
        "listen: must be HOST:PORT, e.g. 0.0.0.0:8080 (got 8080)",
        "timeouts.connect: Input should be greater than 0 (got 0)",
        "mode_options.scope: Input should be 'session' or 'tree' (got 'forest')",
    ]
    missing = tmp_path / "missing"
    f = write(
        tmp_path,
        yaml.safe_dump(
            {
                "admin_tokens_file": str(missing / "tokens.yaml"),
                "state": {"url": "redis://store:6379", "password_file": str(missing / "password")},
                "deployments": [
                    {"name": "a", "upstreams": ["http://gw:1"], "timeouts": {"connect": 0}},
                    {
                        "name": "b",
                        "upstreams": ["https://gw:2"],
                        "tls": {"ca_file": str(missing / "ca.pem")},
                        "mode": "dynamo_nvext",
                        "mode_options": {"timeout_secs": 5},
                    },
                ],
            }
        ),
    )
    result = check_config(str(f), env=clean_env())
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "sidecar: invalid configuration:",
        "deployments[0].timeouts.connect: Input should be greater than 0 (got 0)",
        "deployments[1].mode_options.timeout_secs: unknown setting",
        f"deployments[1].tls.ca_file: cannot read {missing}/ca.pem: No such file or directory",
        f"state.password_file: cannot read {missing}/password: No such file or directory",
        f"admin_tokens_file ({missing}/tokens.yaml): No such file or directory",
    ]


def test_check_config_without_a_complete_configuration_exits_2():
    result = check_config(env=clean_env())
    assert result.returncode == 2
    assert "upstream: required" in result.stderr
    result = check_config(env=clean_env(SIDECAR_UPSTREAM=UP, SIDECAR_LISTEN="8080"))
    assert result.returncode == 2
    assert "listen: must be HOST:PORT, e.g. 0.0.0.0:8080 (got '8080')" in result.stderr


def test_version_flag():
    result = subprocess.run([sys.executable, "-m", "sidecar", "--version"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.strip() == f"sidecar {sidecar.__version__}"


# -- admin tokens ---------------------------------------------------------------------------------

PLACEHOLDERS = [
    "CHANGE-ME-replace-with-openssl-rand-hex-32",
    "changeme-0123456789abcdef",
    "replace-this-with-a-real-token",
    "<your-admin-token-here>",
    "example-token-0123456789",
    "0123456789-PLACEHOLDER",
    "ChangeMe0123456789abcdef",
    "change_me_0123456789abc",
]


def tokens_file(tmp_path: Path, token: str) -> Path:
    return write(
        tmp_path,
        yaml.safe_dump({"tokens": [{"token": "f" * 32, "admin": True}, {"token": token, "workspace": "team-a"}]}),
        "tokens.yaml",
    )


@pytest.mark.parametrize("token", PLACEHOLDERS)
def test_placeholder_tokens_are_refused_naming_the_entry_never_the_token(tmp_path, token):
    with pytest.raises(ConfigError) as exc:
        load_tokens(tokens_file(tmp_path, token))
    message = str(exc.value)
    assert "tokens[1].token: is a placeholder" in message and "openssl rand -hex 32" in message
    assert token not in message


def test_short_tokens_are_refused_and_random_ones_accepted(tmp_path):
    with pytest.raises(ConfigError, match=r"tokens\[1\]\.token: must be a string of at least 16 characters"):
        load_tokens(tokens_file(tmp_path, "0123456789abcde"))
    with pytest.raises(ConfigError, match=r"tokens\[1\]\.token: must be"):
        load_tokens(tokens_file(tmp_path, "0123456789\tabcdefgh"))
    assert (
        load_tokens(tokens_file(tmp_path, "3f9a1c0e5b7d2468ace13579bdf02468"))
        .authenticate("Bearer 3f9a1c0e5b7d2468ace13579bdf02468")
        .workspace
        == "team-a"
    )


def test_the_sidecar_refuses_to_start_with_a_placeholder_token(tmp_path):
    token = "CHANGE-ME-replace-with-openssl-rand-hex-32"
    env = clean_env(SIDECAR_UPSTREAM=UP, SIDECAR_ADMIN_TOKENS_FILE=str(tokens_file(tmp_path, token)))
    for command in (["run", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"], ["check-config"]):
        result = subprocess.run(
            [sys.executable, "-m", "sidecar", *command], capture_output=True, text=True, timeout=30, env=env
        )
        assert result.returncode == 2, (command, result.stderr)
        assert "tokens[1].token: is a placeholder" in result.stderr
        assert token not in result.stderr + result.stdout


def test_tokens_file_yaml_error_names_the_line_not_the_token(tmp_path):
    secret = "9d1e7c3b5a0f2468ace13579bdf02468"
    f = write(tmp_path, f"tokens:\n  - {{token: {secret}, admin: true\n  - oops: [\n", "tokens.yaml")
    with pytest.raises(ConfigError) as exc:
        load_tokens(f)
    assert re.search(r", line \d+, column \d+: invalid YAML$", str(exc.value)), str(exc.value)
    assert secret not in str(exc.value)


def test_the_chart_refuses_the_same_placeholders():
    """One pattern for both: the chart's checkTokens template and sidecar.auth.PLACEHOLDER."""
    chart = re.findall(r'regexMatch "([^"]+)" \$token', CHART_HELPERS.read_text())
    patterns = [p for p in chart if p != "\\\\s"]
    assert patterns == [PLACEHOLDER.pattern]
    assert all(PLACEHOLDER.search(t) for t in PLACEHOLDERS)
