"""Configuration: precedence, validation with the setting named, example configs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.config import build_config
from sidecar.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
UP = "http://127.0.0.1:18000"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults():
    cfg = build_config(flags={"upstream": UP}, env={})
    assert str(cfg.listen) == "127.0.0.1:8080"
    assert str(cfg.admin) == "127.0.0.1:9091"
    # the generic family's ordered headers, then Claude Code's and Codex's own families
    assert cfg.identity.clients == ["generic", "claude_code", "codex"]
    assert cfg.identity.session == ["X-Correlation-ID", "X-Session-Affinity", "X-Session-ID"]
    assert cfg.identity.body == [] and cfg.identity.fingerprint is False  # body signals are opt-in
    [dep] = cfg.resolved_deployments()
    assert dep.name == "default" and dep.upstreams == [UP] and dep.mode is None


def test_precedence_flags_over_env_over_file(tmp_path):
    f = write(tmp_path, "listen: 127.0.0.1:1001\nadmin: 127.0.0.1:2001\nupstream: http://file:1\nengine: aiohttp\n")
    env = {"SIDECAR_LISTEN": "127.0.0.1:1002", "SIDECAR_UPSTREAM": "http://env:1"}
    cfg = build_config(flags={"listen": "127.0.0.1:1003"}, env=env, file=f)
    assert str(cfg.listen) == "127.0.0.1:1003"  # flag
    assert cfg.upstream == "http://env:1"  # env beats file
    assert str(cfg.admin) == "127.0.0.1:2001"  # file beats default


def test_config_file_from_env(tmp_path):
    f = write(tmp_path, f"upstream: {UP}\nmode: dynamo_headers\n")
    cfg = build_config(env={"SIDECAR_CONFIG": str(f)})
    assert cfg.mode == "dynamo_headers"


def test_env_mode_opts_and_flag_mode_opt_merge():
    from sidecar.config import _env_layer

    assert _env_layer({"SIDECAR_MODE_OPTS": "a=1, b=x,y"}) == {"mode_options": {"a": "1", "b": "x,y"}}


def test_mode_replaced_by_higher_layer_drops_lower_options(tmp_path):
    f = write(tmp_path, f"upstream: {UP}\nmode: nonexistent_file_mode\nmode_options: {{x: 1}}\n")
    cfg = build_config(flags={"mode": "dynamo_headers"}, env={}, file=f)
    assert cfg.mode == "dynamo_headers" and cfg.mode_options == {}


@pytest.mark.parametrize(
    ("flags", "file", "needle"),
    [
        ({}, "", "upstream: required"),
        ({"upstream": "ftp://x"}, "", "upstream: must be an http:// or https:// URL"),
        ({"upstream": UP, "listen": "nope"}, "", "listen: must be HOST:PORT"),
        ({"upstream": UP, "listen": "127.0.0.1:70000"}, "", "listen.port: Input should be less than or equal to 65535"),
        ({"upstream": UP, "mode": "no_such_mode"}, "", "mode: unknown mode 'no_such_mode'"),
        (
            {"upstream": UP, "mode": "dynamo_headers", "mode_opt": ["timeout_seconds=5"]},
            "",
            "mode_options.timeout_seconds: unknown setting",
        ),
        ({"upstream": UP, "mode_opt": ["a=1"]}, "", "mode_options: given without a mode"),
        ({"upstream": UP, "mode": "dynamo_headers", "mode_opt": ["novalue"]}, "", "--mode-opt: expected key=value"),
        ({"upstream": UP}, "timeouts: {connect: 0}", "timeouts.connect: Input should be greater than 0"),
        ({"upstream": UP}, "limits: {max_body_bytes: abc}", "limits.max_body_bytes: Input should be a valid integer"),
        ({"upstream": UP}, "bogus_key: 1", "bogus_key: unknown setting"),
        ({"upstream": UP}, "identity: {session: 'X-Correlation-ID, bad name'}", "identity.session: Value error"),
        ({"upstream": UP}, "identity: {session: X-Request-ID}", "X-Request-ID is a per-request id"),
        (
            {"upstream": UP},
            "identity: {parent: [X-Parent, content-length]}",
            "identity.parent: 'content-length' frames or routes the message itself",
        ),
        ({}, "deployments: [{name: a, upstreams: []}]", "deployments[0].upstreams: List should have at least 1 item"),
        (
            {},
            "deployments: [{name: a, upstreams: ['http://x:1'], mode: dynamo_headers, mode_options: {k: 1}}]",
            "deployments[0].mode_options.k: unknown setting",
        ),
        ({}, "upstream: http://x:1\ndeployments: [{name: a, upstreams: ['http://x:1']}]", "not both"),
    ],
)
def test_invalid_config_names_the_setting(tmp_path, flags, file, needle):
    f = write(tmp_path, file) if file else None
    with pytest.raises(ConfigError) as info:
        build_config(flags=flags, env={}, file=f)
    msg = str(info.value)
    # pydantic phrases some messages itself; the setting path is what must be exact.
    assert needle.split(" Value error")[0] in msg, msg


def test_invalid_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="invalid YAML"):
        build_config(env={}, file=write(tmp_path, "a: [1,"))
    with pytest.raises(ConfigError, match="config file .*missing.yaml"):
        build_config(env={}, file=tmp_path / "missing.yaml")


@pytest.mark.parametrize("path", sorted((ROOT / "config" / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load(path):
    cfg = build_config(env={}, file=path)
    assert cfg.resolved_deployments()
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "check-config", str(path)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert "deployments:" in result.stdout


def test_check_config_exit_2_names_setting(tmp_path):
    f = write(tmp_path, f"upstream: {UP}\nmode: dynamo_headers\ntimeouts: {{idle: -1}}\n")
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "check-config", str(f)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "timeouts.idle: Input should be greater than 0 (got -1)" in result.stderr


def test_full_example_documents_exactly_the_defaults():
    full = build_config(env={}, file=ROOT / "config" / "examples" / "full.yaml")
    defaults = build_config(flags={"upstream": full.upstream, "mode": full.mode}, env={})
    assert full.normalized() == defaults.normalized()


STREAM_BATCH_REMOVED = "it had no effect: streamed bodies are relayed by the engine's stream thread without batching"


def test_stream_batch_us_is_removed_and_refused_with_why(tmp_path):
    """It did nothing any more (streamed bodies are relayed without batching): `check-config` no
    longer shows it, and a configuration that still sets it is told to delete it."""
    from tests.config.test_early import check_config, clean_env

    shown = check_config(env=clean_env(SIDECAR_UPSTREAM=UP))
    assert shown.returncode == 0 and "stream_batch_us" not in shown.stdout
    result = check_config(str(write(tmp_path, f"upstream: {UP}\nstream_batch_us: 2000\n")), env=clean_env())
    assert (result.returncode, result.stderr) == (
        2,
        f"sidecar: invalid configuration:\nstream_batch_us: removed ({STREAM_BATCH_REMOVED}): delete it from the "
        "configuration\n",
    )
    result = check_config(env=clean_env(SIDECAR_UPSTREAM=UP, SIDECAR_STREAM_BATCH_US="1000"))
    assert (result.returncode, result.stderr) == (
        2,
        f"sidecar: invalid configuration:\nSIDECAR_STREAM_BATCH_US: stream_batch_us was removed "
        f"({STREAM_BATCH_REMOVED}): delete the variable\n",
    )
