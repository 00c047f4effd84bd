"""Mode options are validated when the config loads; every error names the setting."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from sidecar.config import build_config
from sidecar.errors import ConfigError
from tests.proxy.test_errors import free_ports

UP = "http://127.0.0.1:9"


def load(mode: str | None, *opts: str) -> Any:
    return build_config(flags={"upstream": UP, "mode": mode, "mode_opt": list(opts)}, env={})


def options(mode: str, *opts: str) -> dict[str, Any]:
    return load(mode, *opts).normalized()["deployments"][0]["mode_options"]


def error(mode: str | None, *opts: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(mode, *opts)
    return str(info.value)


# -- coercion and canonical forms -------------------------------------------------------------


def test_flag_strings_are_coerced_and_canonicalized() -> None:
    assert options("dynamo_nvext", "timeout_seconds=123", "scope= Tree ", "protocol=OPEN") == {
        "scope": "tree",
        "timeout_seconds": 123,
        "protocol": "open",
    }
    assert options("dynamo_nvext") == {"scope": "session", "timeout_seconds": 300, "protocol": "open"}
    assert options("smg_routing_key", "scope=TREE") == {"scope": "tree"}
    assert options("session_id_header", "header_name= X-Mine ") == {"scope": "session", "header_name": "X-Mine"}
    assert options("session_id_header") == {"scope": "session", "header_name": "X-Session-ID"}
    assert options("identity_headers", "session= X-A ,X-B", "root=X-R") == {
        "session": ["X-A", "X-B"],
        "parent": [],
        "root": ["X-R"],
    }
    assert options("dynamo_headers") == {}


def test_env_mode_opts_split_identity_lists_correctly() -> None:
    cfg = build_config(
        env={
            "SIDECAR_UPSTREAM": UP,
            "SIDECAR_MODE": "identity_headers",
            "SIDECAR_MODE_OPTS": "session=X-A,X-B,parent=X-P",
        }
    )
    assert cfg.normalized()["deployments"][0]["mode_options"] == {
        "session": ["X-A", "X-B"],
        "parent": ["X-P"],
        "root": [],
    }


def test_yaml_values_are_typed(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "upstream": UP,
                "mode": "identity_headers",
                "mode_options": {"session": ["X-A", "X-B"], "parent": "X-P1, X-P2"},
            }
        )
    )
    assert build_config(file=f, env={}).normalized()["deployments"][0]["mode_options"] == {
        "session": ["X-A", "X-B"],
        "parent": ["X-P1", "X-P2"],
        "root": [],
    }


# -- rejected values -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode,opts",
    [
        ("dynamo_nvext", ["timeout_secs=5"]),
        ("smg_routing_key", ["header_name=X"]),
        ("session_id_header", ["headername=X"]),
        ("identity_headers", ["session=X-A", "sessions=X"]),
    ],
)
def test_unknown_keys_are_errors(mode: str, opts: list[str]) -> None:
    key = opts[-1].partition("=")[0]
    assert error(mode, *opts) == f"mode_options.{key}: unknown setting"


@pytest.mark.parametrize("opt", ["scope=tree", "timeout_seconds=5", "anything=1"])
def test_parameterless_mode_rejects_every_key(opt: str) -> None:
    key = opt.partition("=")[0]
    assert error("dynamo_headers", opt) == f"mode_options.{key}: unknown setting"


def test_options_without_a_mode() -> None:
    assert "mode_options: given without a mode" in error(None, "timeout_seconds=5")


def test_options_without_a_mode_in_a_deployment(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"deployments": [{"upstreams": [UP], "mode_options": {"scope": "tree"}}]}))
    with pytest.raises(ConfigError, match=r"deployments\[0\].*mode_options: given without a mode"):
        build_config(file=f, env={})


@pytest.mark.parametrize(
    "value,needle",
    [
        ("0", "greater than or equal to 1"),
        ("-5", "greater than or equal to 1"),
        ("abc", "valid integer"),
        ("1.5", "valid integer"),
        ("", "valid integer"),
    ],
)
def test_bad_timeouts(value: str, needle: str) -> None:
    msg = error("dynamo_nvext", f"timeout_seconds={value}")
    assert msg.startswith("mode_options.timeout_seconds: ") and needle in msg


@pytest.mark.parametrize("value", [True, False, 2.5, [1], {"a": 1}])
def test_bad_timeouts_from_yaml(tmp_path: Path, value: Any) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"upstream": UP, "mode": "dynamo_nvext", "mode_options": {"timeout_seconds": value}}))
    with pytest.raises(ConfigError, match=r"^mode_options\.timeout_seconds: "):
        build_config(file=f, env={})


@pytest.mark.parametrize("opt", ["scope=forest", "protocol=bind2"])
def test_bad_choices(opt: str) -> None:
    key = opt.partition("=")[0]
    assert error("dynamo_nvext", opt).startswith(f"mode_options.{key}: Input should be ")


@pytest.mark.parametrize(
    "name",
    ["X Session", "X:Session", "X-Session\r\nX-Evil", "X-Session\nX", "X-Séssion", "(X)", "X@Y", "X/Y", 'X"Y', "X\tY"],
)
def test_session_id_header_name_must_be_a_token(tmp_path: Path, name: str) -> None:
    # Leading / trailing whitespace is stripped (canonical form); anything inside must be a token.
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"upstream": UP, "mode": "session_id_header", "mode_options": {"header_name": name}}))
    with pytest.raises(ConfigError, match=r"^mode_options\.header_name: .*not a valid header name"):
        build_config(file=f, env={})


@pytest.mark.parametrize("name", ["", "   "])
def test_session_id_header_name_non_empty(tmp_path: Path, name: str) -> None:
    assert error("session_id_header", f"header_name={name}") == (
        "mode_options.header_name: header name must not be empty (got '')"
    )


@pytest.mark.parametrize("name", ["Content-Length", "transfer-encoding", "Host", "Connection"])
def test_proxy_managed_headers_cannot_be_emitted(name: str) -> None:
    assert "managed by the proxy" in error("session_id_header", f"header_name={name}")
    assert "managed by the proxy" in error("identity_headers", f"root={name}")


@pytest.mark.parametrize("tier", ["session", "parent", "root"])
@pytest.mark.parametrize("name", ["X Session", "X:Session", "X-Session\r\nX-Evil", "X-Séssion"])
def test_identity_header_names_must_be_tokens(tmp_path: Path, tier: str, name: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"upstream": UP, "mode": "identity_headers", "mode_options": {tier: ["X-Fine", name]}}))
    with pytest.raises(ConfigError, match=rf"^mode_options\.{tier}\[1\]: .*not a valid header name"):
        build_config(file=f, env={})


def test_identity_header_names_non_empty_in_lists(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        yaml.safe_dump({"upstream": UP, "mode": "identity_headers", "mode_options": {"session": ["X-A", "  "]}})
    )
    with pytest.raises(ConfigError, match=r"^mode_options\.session\[1\]: header name must not be empty"):
        build_config(file=f, env={})


@pytest.mark.parametrize("opts", [[], ["session="], ["session= , ", "parent=", "root= "]])
def test_identity_headers_needs_at_least_one_name(opts: list[str]) -> None:
    assert "at least one" in error("identity_headers", *opts)
    assert error("identity_headers", *opts).startswith("mode_options.")


@pytest.mark.parametrize(
    "opts,path,dup",
    [
        (["session=X-A, x-a"], "session", "x-a"),
        (["session=X-A", "parent=X-P, X-a"], "parent", "X-a"),
        (["session=X-A", "root=X-R,X-A"], "root", "X-A"),
        (["parent=X-P", "root=x-p"], "root", "x-p"),
        (["session=X-S", "parent=X-P", "root=X-R, X-S"], "root", "X-S"),
    ],
)
def test_identity_header_names_unique_across_tiers(opts: list[str], path: str, dup: str) -> None:
    msg = error("identity_headers", *opts)
    assert msg.startswith(f"mode_options.{path}: header {dup!r} is named ")
    assert "case-insensitively" in msg


def test_errors_in_a_deployment_carry_its_path(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "deployments": [
                    {"name": "a", "upstreams": [UP], "mode": "smg_routing_key"},
                    {"name": "b", "upstreams": [UP], "mode": "dynamo_nvext", "mode_options": {"timeout_secs": 5}},
                ]
            }
        )
    )
    with pytest.raises(ConfigError) as info:
        build_config(file=f, env={})
    assert str(info.value) == "deployments[1].mode_options.timeout_secs: unknown setting"


def test_unknown_mode_is_named() -> None:
    msg = error("dynamo_nvxt")
    assert msg.startswith("mode: unknown mode 'dynamo_nvxt'") and "dynamo_nvext" in msg


# -- the CLI --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode_options,needle",
    [
        ({"timeout_secs": 5}, "mode_options.timeout_secs: unknown setting"),
        ({"timeout_seconds": 0}, "mode_options.timeout_seconds: Input should be greater than or equal to 1"),
    ],
)
def test_check_config_exits_2_naming_the_setting(tmp_path: Path, mode_options: dict[str, Any], needle: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"upstream": UP, "mode": "dynamo_nvext", "mode_options": mode_options}))
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar", "check-config", str(f)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr


def test_check_config_identity_duplicate_exits_2(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        yaml.safe_dump(
            {"upstream": UP, "mode": "identity_headers", "mode_options": {"session": "X-A", "root": ["x-A"]}}
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar", "check-config", str(f)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert "mode_options.root: header 'x-A' is named in both session and root" in proc.stderr


def test_check_config_prints_canonical_options(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        yaml.safe_dump(
            {"upstream": UP, "mode": "dynamo_nvext", "mode_options": {"timeout_seconds": "123", "scope": "Tree"}}
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar", "check-config", str(f)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    dep = yaml.safe_load(proc.stdout)["deployments"][0]
    assert dep["mode_options"] == {"scope": "tree", "timeout_seconds": 123, "protocol": "open"}


def test_modes_command_says_which_dynamo_releases_dynamo_nvext_is_for() -> None:
    out = subprocess.run([sys.executable, "-m", "sidecar", "modes"], capture_output=True, text=True, timeout=30).stdout
    lines = out.splitlines()
    at = lines.index("dynamo_nvext (mutates the request body)")
    assert lines[at + 1] == (
        "    Dynamo 1.1.x-1.2.x only: nvext.session_control open/close in the JSON body (bind: 1.3.0 dev builds "
        "only; 1.3.0 and later reject it: use dynamo_headers)."
    )
    assert (
        "    protocol: open|bind, default 'open' - open: open / - / close, what Dynamo 1.1.x-1.2.x accept; bind: bind "
        "/ close, accepted only by 1.3.0 development builds"
    ) in lines[at + 2 : at + 5]


@pytest.mark.parametrize(
    "protocol, notice",
    [
        (
            [],
            "dynamo_nvext sends nvext.session_control open / close, which only Dynamo 1.1.x-1.2.x accept, and apply "
            "only for workers that serve sessions (SGLang with --enable-streaming-session); Dynamo 1.3.0 and later "
            "answer it with HTTP 400 (unknown field session_control): use dynamo_headers for them",
        ),
        (
            ["--mode-opt", "protocol=bind"],
            "dynamo_nvext sends nvext.session_control bind / close (protocol: bind), which only Dynamo 1.3.0 "
            "development builds accept; released Dynamo 1.1.x-1.2.x answer HTTP 400 (unknown variant bind: use "
            "protocol: open), 1.3.0 and later HTTP 400 (unknown field session_control: use dynamo_headers)",
        ),
    ],
)
async def test_run_logs_which_dynamo_releases_the_mode_works_with(upstream, protocol, notice) -> None:
    from tests.test_cli import spawn, stop, wait_healthy

    port, admin_port = free_ports(2)
    proc = spawn(
        *["--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin_port}", "--upstream", upstream.url],
        *["--mode", "dynamo_nvext", *protocol],
        env={"SIDECAR_SHUTDOWN_DELAY_SECONDS": "0"},
    )
    try:
        await wait_healthy(f"http://127.0.0.1:{admin_port}", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        lines = [orjson.loads(line) for line in (proc.stderr.read() if proc.stderr else "").splitlines()]
    finally:
        stop(proc)
    (line,) = [x for x in lines if x["msg"].startswith("dynamo_nvext sends")]
    assert (line["level"], line["msg"], line["deployment"], line["mode"]) == (
        "warning",
        notice,
        "default",
        "dynamo_nvext",
    )


def test_modes_command_lists_every_builtin_with_options() -> None:
    proc = subprocess.run([sys.executable, "-m", "sidecar", "modes"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    for needle in (
        "dynamo_headers",
        "dynamo_nvext (mutates the request body)",
        "timeout_seconds",
        "protocol",
        "smg_routing_key",
        "session_id_header",
        "header_name",
        "identity_headers",
    ):
        assert needle in proc.stdout
