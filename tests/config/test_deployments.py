"""Validation of the deployments settings, naming the setting."""

from __future__ import annotations

import pytest

from sidecar.config import build_config
from sidecar.errors import ConfigError
from tests.sessions.support import write_yaml

UP = "http://127.0.0.1:18000"


def load(**keys):
    return build_config(env={}, file=write_yaml(keys))


@pytest.mark.parametrize(
    ("keys", "needle"),
    [
        (
            {
                "deployments": [
                    {"name": "a", "upstreams": [UP], "models": ["m"]},
                    {"name": "b", "upstreams": [UP], "models": ["m"]},
                ]
            },
            "deployments[1].models: 'm' is already served by deployment 'a'",
        ),
        (
            {"deployments": [{"name": "a", "upstreams": [UP]}], "default_deployment": "b"},
            "default_deployment: names no",
        ),
        ({"upstream": UP, "default_deployment": "x"}, "default_deployment"),
        ({"upstream": UP, "deployment_header": "bad header"}, "deployment_header"),
        (
            {"deployments": [{"name": "a", "upstreams": [UP], "health_check": {"interval_seconds": 0}}]},
            "deployments[0].health_check.interval_seconds",
        ),
        (
            {"deployments": [{"name": "a", "upstreams": [UP], "health_check": {"path": "health"}}]},
            "deployments[0].health_check.path",
        ),
        ({"deployments": [{"name": "a", "upstreams": [UP], "failback": "sometimes"}]}, "deployments[0].failback"),
        ({"upstream": UP, "sessions": {"api": {"max_sessions": 0}}}, "sessions.api.max_sessions"),
        ({"upstream": UP, "admin": "10.1.2.3:9091"}, "admin_insecure"),
    ],
)
def test_invalid_deployment_settings(keys, needle):
    with pytest.raises(ConfigError) as info:
        load(**keys)
    assert needle in str(info.value), str(info.value)


def test_short_form_is_one_default_deployment():
    cfg = load(upstream=UP, mode="dynamo_headers")
    [dep] = cfg.resolved_deployments()
    assert dep.name == "default" and dep.upstreams == [UP] and not dep.strict
    assert cfg.deployment_header == "X-Sidecar-Deployment" and cfg.default_deployment is None


@pytest.mark.parametrize(
    "key, value",
    [
        ("trust_client_headers", True),
        ("non_object_body", "reject"),
        ("timeouts", {"connect": 1}),
        ("limits", {"max_body_bytes": 10}),
        ("tls", {"verify": False}),
    ],
)
def test_short_form_settings_beside_deployments_are_refused_not_ignored(key, value):
    with pytest.raises(ConfigError) as err:
        load(deployments=[{"name": "a", "upstreams": ["http://127.0.0.1:9"], "mode": "generic"}], **{key: value})
    assert f"{key}: with `deployments`" in str(err.value)
