"""The limits of bodies the sidecar reads as JSON: configuration and validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.config import LimitsConfig, build_config
from sidecar.errors import ConfigError

UP = "http://127.0.0.1:9"


def config(tmp_path: Path, **keys: Any) -> Any:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(keys))
    return build_config(flags={}, env={}, file=str(f))


def test_defaults() -> None:
    limits = LimitsConfig()
    assert (limits.max_parsed_body_bytes, limits.max_json_depth) == (8 * 1024 * 1024, 128)
    assert limits.max_parsed_body_bytes <= limits.max_body_bytes


def test_the_default_follows_a_lower_body_limit(tmp_path: Path) -> None:
    cfg = config(tmp_path, upstream=UP, limits={"max_body_bytes": 1000})
    assert cfg.limits.max_parsed_body_bytes == 1000
    assert cfg.normalized()["deployments"][0]["limits"]["max_parsed_body_bytes"] == 1000


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"upstream": UP, "limits": {"max_body_bytes": 1000, "max_parsed_body_bytes": 2000}},
            r"^limits\.max_parsed_body_bytes: must not exceed max_body_bytes \(1000\) \(got 2000\)$",
        ),
        (
            {"upstream": UP, "limits": {"max_parsed_body_bytes": 100 * 1024 * 1024}},
            r"^limits\.max_parsed_body_bytes: must not exceed max_body_bytes",
        ),
        ({"upstream": UP, "limits": {"max_parsed_body_bytes": 0}}, r"^limits\.max_parsed_body_bytes: .*greater than"),
        ({"upstream": UP, "limits": {"max_json_depth": 0}}, r"^limits\.max_json_depth: .*greater than"),
        ({"upstream": UP, "limits": {"max_json_depth": 256}}, r"^limits\.max_json_depth: .*less than or equal to 255"),
        (
            {
                "deployments": [
                    {"name": "a", "upstreams": [UP], "limits": {"max_body_bytes": 10, "max_parsed_body_bytes": 11}}
                ]
            },
            r"^deployments\[0\]\.limits\.max_parsed_body_bytes: must not exceed",
        ),
    ],
)
def test_invalid_limits_name_the_setting(tmp_path: Path, keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, **keys)


def test_per_deployment_limits(tmp_path: Path) -> None:
    cfg = config(
        tmp_path,
        deployments=[
            {"name": "a", "upstreams": [UP], "limits": {"max_parsed_body_bytes": 1024, "max_json_depth": 8}},
            {"name": "b", "upstreams": [UP]},
        ],
    )
    a, b = cfg.resolved_deployments()
    assert (a.limits.max_parsed_body_bytes, a.limits.max_json_depth) == (1024, 8)
    assert (b.limits.max_parsed_body_bytes, b.limits.max_json_depth) == (8 * 1024 * 1024, 128)
