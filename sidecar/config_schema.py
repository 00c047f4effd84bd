"""The configuration file's JSON Schema, generated from :class:`sidecar.config.Config`.

``python -m sidecar.config_schema`` prints it; ``python -m sidecar.config_schema --embed FILE``
writes it into another schema's ``definitions`` (the Helm chart's ``values.schema.json``, whose
``config`` value it checks). The schema is draft-07 and self-contained: pydantic's ``$defs``
references are inlined, so it can be copied anywhere. Every object with named settings has
``additionalProperties: false``, so a misspelled key is an error; free-form maps
(``mode_options``, checked by the mode itself) stay open.

It describes the canonical spelling of each setting, which the model accepts as is:
``listen: "0.0.0.0:8080"``, header lists as a list or one comma-separated string. Where the
model also coerces other input (``"20"`` for a number, ``INFO`` for ``info``), the schema is the
stricter of the two.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from sidecar.config import Config, HostPort, parse_host_port
from sidecar.validation import split_names

DRAFT_07 = "http://json-schema.org/draft-07/schema#"
# The key under `definitions` that --embed writes (the chart refers to it).
EMBED_KEY = "sidecarConfig"
# HOST:PORT or [v6]:PORT, as sidecar.config.parse_host_port reads it.
HOST_PORT_PATTERN = r"^\s*(\[[0-9a-fA-F:.]+\]|[^:\[\]]+):[0-9]+\s*$"


class _Generator(GenerateJsonSchema):
    """pydantic's generator, taught the input forms of the config's before-validators."""

    def function_before_schema(self, schema: core_schema.BeforeValidatorFunctionSchema) -> JsonSchemaValue:
        inner = super().function_before_schema(schema)
        function = schema["function"]["function"]
        if function is parse_host_port:
            return {"type": "string", "pattern": HOST_PORT_PATTERN}
        if function is split_names:
            return {"anyOf": [inner, {"type": "string"}]}
        return inner

    def encode_default(self, dft: Any) -> Any:
        if isinstance(dft, HostPort):
            return str(dft)
        return super().encode_default(dft)


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft-07, self-contained) of the sidecar's configuration file."""
    raw = Config.model_json_schema(schema_generator=_Generator)
    definitions = raw.pop("$defs", {})
    schema = _inline(raw, definitions, ())
    return {"$schema": DRAFT_07, "title": "session-sidecar configuration", **schema}


def _inline(node: Any, definitions: dict[str, Any], stack: tuple[str, ...]) -> Any:
    """``node`` with every ``$ref`` replaced by its definition, titles dropped, and objects with
    named properties closed (``additionalProperties: false``)."""
    if isinstance(node, list):
        return [_inline(item, definitions, stack) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    ref = node.get("$ref")
    if ref is not None:
        name = ref.removeprefix("#/$defs/")
        if name in stack:
            raise ValueError(f"config model is recursive at {name}: it cannot be inlined")
        out.update(_inline(definitions[name], definitions, (*stack, name)))
    for key, value in node.items():
        if key in ("$ref", "title"):
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {name: _inline(sub, definitions, stack) for name, sub in value.items()}
        elif key in ("default", "examples", "const", "enum"):
            out[key] = value
        else:
            out[key] = _inline(value, definitions, stack)
    if "properties" in out:
        out["additionalProperties"] = False
    return out


def embed(target: Path) -> bool:
    """Write the schema into ``target``'s ``definitions`` under :data:`EMBED_KEY`.

    Returns whether the file changed. The rest of ``target`` is kept as it is.
    """
    text = target.read_text(encoding="utf-8")
    document = json.loads(text)
    schema = config_json_schema()
    schema.pop("$schema")
    document.setdefault("definitions", {})[EMBED_KEY] = schema
    new = json.dumps(document, indent=2) + "\n"
    if new == text:
        return False
    target.write_text(new, encoding="utf-8")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sidecar.config_schema", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--embed",
        metavar="FILE",
        type=Path,
        help=f"write the schema into FILE's definitions.{EMBED_KEY} instead of printing it",
    )
    args = parser.parse_args(argv)
    if args.embed is None:
        json.dump(config_json_schema(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        changed = embed(args.embed)
        print(f"{args.embed}: {'updated' if changed else 'already up to date'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
