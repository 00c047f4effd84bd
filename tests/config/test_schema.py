"""The config file's JSON Schema (sidecar.config_schema) and the copy the Helm chart ships."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema_rs  # a dependency of schemathesis (the test extra)
import pytest
import yaml

from sidecar.config import build_config
from sidecar.config_schema import EMBED_KEY, config_json_schema, embed, main

ROOT = Path(__file__).resolve().parents[2]
VALUES_SCHEMA = ROOT / "deploy" / "helm" / "session-sidecar" / "values.schema.json"
EXAMPLES = sorted((ROOT / "config" / "examples").glob("*.yaml"))
REGENERATE = f"python -m sidecar.config_schema --embed {VALUES_SCHEMA.relative_to(ROOT)}"


def errors(instance: Any) -> list[tuple[str, str]]:
    validator = jsonschema_rs.Draft7Validator(config_json_schema())
    return [("/".join(map(str, e.instance_path)), e.message) for e in validator.iter_errors(instance)]


def walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every subschema with its path."""
    found = []
    if isinstance(node, dict):
        found.append((path, node))
        for key, value in node.items():
            if key not in ("default", "examples", "const", "enum"):
                found.extend(walk(value, f"{path}/{key}"))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.extend(walk(value, f"{path}/{i}"))
    return found


def test_chart_ships_the_schema_of_the_current_model() -> None:
    shipped = json.loads(VALUES_SCHEMA.read_text())["definitions"].get(EMBED_KEY)
    expected = config_json_schema()
    expected.pop("$schema")
    assert shipped == expected, (
        f"the Helm chart's copy of the config schema ({VALUES_SCHEMA.relative_to(ROOT)}, "
        f"definitions.{EMBED_KEY}) differs from what sidecar.config.Config generates: run `{REGENERATE}`"
    )


def test_embed_rewrites_only_its_own_definition(tmp_path: Path) -> None:
    target = tmp_path / "values.schema.json"
    target.write_text(
        json.dumps({"type": "object", "definitions": {"port": {"type": "integer"}, EMBED_KEY: {"stale": True}}})
    )
    assert embed(target) is True
    document = json.loads(target.read_text())
    assert document["definitions"]["port"] == {"type": "integer"} and document["type"] == "object"
    assert document["definitions"][EMBED_KEY]["properties"]["drain_grace_seconds"]["type"] == "number"
    assert embed(target) is False, "a second run changes nothing"


def test_schema_is_draft07_self_contained_and_closed() -> None:
    schema = config_json_schema()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema_rs.Draft7Validator(schema)  # a valid schema
    for path, node in walk(schema):
        assert "$ref" not in node and "$defs" not in node, f"{path}: not self-contained"
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{path}: an object that accepts unknown keys"
    assert json.loads(json.dumps(schema)) == schema


def test_main_prints_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert json.loads(capsys.readouterr().out) == config_json_schema()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_configs_match_the_schema(example: Path) -> None:
    """The documented config files (every setting in its canonical form) pass the schema."""
    data = yaml.safe_load(example.read_text())
    assert errors(data) == []


def test_canonical_input_forms_pass() -> None:
    """What the model accepts in its canonical form passes the schema too (before-validators)."""
    config = {
        "listen": "0.0.0.0:8080",
        "admin": "[::1]:9091",
        "identity": {"session": "X-Session-ID, X-Correlation-ID", "parent": ["X-Parent-Session-ID"]},
        "affinity": {"worker_headers": "x-worker"},
        "upstream": "http://router:8000",
        "mode": "session_id_header",
        "mode_options": {"scope": "tree"},
    }
    assert errors(config) == []
    build_config(env={}, flags=config)  # and the sidecar accepts it


@pytest.mark.parametrize(
    ("config", "where"),
    [
        ({"drain_grace_secs": 5}, ""),
        ({"sessions": {"idle_ttl": 5}}, "sessions"),
        ({"sessions": {"api": {"max_session": 5}}}, "sessions/api"),
        ({"deployments": [{"name": "a", "upstreams": ["http://a:1"], "timeout": {}}]}, "deployments/0"),
        ({"listen": "8080"}, "listen"),
        ({"log_level": "verbose"}, "log_level"),
        ({"drain_grace_seconds": -1}, "drain_grace_seconds"),
        ({"deployments": [{"name": "a"}]}, "deployments/0"),
    ],
)
def test_schema_rejects_typos_and_bad_values(config: dict[str, Any], where: str) -> None:
    found = errors(config)
    assert found and {path for path, _ in found} == {where}, found
