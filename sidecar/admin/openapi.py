"""The OpenAPI 3.1 description of the admin listener, served at ``/openapi.json``.

Its schemas are generated from the pydantic models of :mod:`sidecar.admin.models` (their
``$defs`` become ``components/schemas``, refs pointing there), then filled in with this
configuration's deployment names and TTL limits; paths, parameters and security are written
here. Nullable scalars read ``"type": ["string", "null"]`` (OpenAPI 3.1 is JSON Schema 2020-12)
and times ``"format": "date-time"`` (RFC 3339).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, models_json_schema
from pydantic_core import core_schema

from sidecar import __version__
from sidecar.admin import models
from sidecar.admin.sessions_api import CURSOR_PATTERN, LIST_DEFAULT_LIMIT, LIST_MAX_LIMIT
from sidecar.admin.views import MAX_DEPTH, MAX_NODES
from sidecar.config import Config

_JSON = "application/json"
_REF = "#/components/schemas/{model}"


class _Schemas(GenerateJsonSchema):
    """pydantic's generator, with nullable scalars as a type list and no per-field titles."""

    def nullable_schema(self, schema: core_schema.NullableSchema) -> JsonSchemaValue:
        out = super().nullable_schema(schema)
        variants = out.get("anyOf")
        if variants is not None and len(variants) == 2 and variants[1] == {"type": "null"}:
            inner = variants[0]
            # An enum or a const would have to list null too: those keep the anyOf.
            if isinstance(inner.get("type"), str) and not {"$ref", "enum", "const"} & inner.keys():
                rest = {k: v for k, v in out.items() if k != "anyOf"}
                return {**rest, **inner, "type": [inner["type"], "null"]}
        return out

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


@functools.cache
def _model_schemas() -> dict[str, Any]:
    """``components/schemas`` generated from the models (the same for every configuration)."""
    _, top = models_json_schema(
        [(m, "validation") for m in models.DOCUMENTED], ref_template=_REF, schema_generator=_Schemas
    )
    return top["$defs"]


def _ref(name: str) -> dict[str, str]:
    if name not in _model_schemas():
        raise KeyError(f"no model named {name!r} in sidecar.admin.models")
    return {"$ref": _REF.format(model=name)}


def _json_body(schema: dict[str, Any], description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": {_JSON: {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    return _json_body(_ref("Error"), description, headers)


def _schemas(config: Config) -> dict[str, Any]:
    """The models' schemas with what this configuration fixes: the deployments a session may be
    bound to, the TTL bounds."""
    api = config.sessions.api
    schemas = copy.deepcopy(_model_schemas())
    props = schemas["SessionCreate"]["properties"]
    props["deployment"]["enum"] = [d.name for d in config.resolved_deployments()]
    ttl = props["ttl_seconds"]
    ttl["maximum"] = api.max_ttl_seconds
    default = "none" if api.default_ttl_seconds is None else f"{api.default_ttl_seconds:g} seconds"
    ttl["description"] += f" (default: {default})"
    return schemas


def build_openapi(config: Config, *, authenticated: bool) -> dict[str, Any]:
    """The document for this configuration (limits and deployment names filled in);
    ``authenticated``: whether ``/v1/*`` requires a bearer token (a tokens file is set)."""
    session_path = {
        "name": "session_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "minLength": 1, "maxLength": 256},
    }
    secured: list[dict[str, list[str]]] = [{"bearerAuth": []}] if authenticated else []
    unauthorized = _error(
        "No or invalid bearer token.", {"WWW-Authenticate": {"schema": {"type": "string"}, "required": True}}
    )
    session_not_found = _error("Unknown, or not visible to the caller (`session_not_found`).")
    paths: dict[str, Any] = {
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "Liveness",
                "security": [],
                "responses": {"200": _json_body(_ref("Status"), "Alive.")},
            }
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "summary": "Readiness",
                "security": [],
                "responses": {
                    "200": _json_body(_ref("Readiness"), "Ready."),
                    "503": _json_body(_ref("Readiness"), "Not ready or draining."),
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics",
                "security": [],
                "responses": {
                    "200": {
                        "description": "Prometheus text format.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "security": [],
                "responses": {"200": _json_body({"type": "object"}, "OpenAPI 3.1 document.")},
            }
        },
        "/v1/sessions": {
            "post": {
                "operationId": "createSession",
                "summary": "Create a session bound to a deployment",
                "security": secured,
                "requestBody": {"required": True, "content": {_JSON: {"schema": _ref("SessionCreate")}}},
                "responses": {
                    "201": _json_body(
                        _ref("Session"), "Created.", {"Location": {"schema": {"type": "string"}, "required": True}}
                    ),
                    "400": _error(
                        "Invalid body, or a `session_id` outside the workspace token's namespace "
                        "(`invalid_request`), or unknown deployment (`unknown_deployment`)."
                    ),
                    "401": unauthorized,
                    "404": _error(
                        "`parent` names no active session of the deployment that the caller "
                        "created (`parent_not_found`)."
                    ),
                    "409": _error("The id is taken (`session_exists`)."),
                    "429": _error("Too many active sessions (`session_limit_reached`)."),
                },
            },
            "get": {
                "operationId": "listSessions",
                "summary": "List the caller's sessions in creation order",
                "security": secured,
                "parameters": [
                    {"name": "deployment", "in": "query", "required": False, "schema": {"type": "string"}},
                    {"name": "status", "in": "query", "required": False, "schema": _ref("SessionStatus")},
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": LIST_MAX_LIMIT,
                            "default": LIST_DEFAULT_LIMIT,
                        },
                    },
                    {
                        "name": "cursor",
                        "in": "query",
                        "required": False,
                        "description": "the `next_cursor` of the previous page (opaque)",
                        "schema": {"type": "string", "pattern": CURSOR_PATTERN},
                    },
                ],
                "responses": {
                    "200": _json_body(_ref("SessionList"), "One page."),
                    "400": _error("Invalid parameter (`invalid_request`)."),
                    "401": unauthorized,
                },
            },
        },
        "/v1/sessions/{session_id}": {
            "get": {
                "operationId": "getSession",
                "summary": "One session with its lineage facts",
                "security": secured,
                "parameters": [session_path],
                "responses": {
                    "200": _json_body(_ref("Session"), "The session."),
                    "401": unauthorized,
                    "404": session_not_found,
                },
            },
        },
        "/v1/sessions/{session_id}/close": {
            "post": {
                "operationId": "closeSession",
                "summary": "Close a session (idempotent)",
                "description": "No request of the session is forwarded once this returned; requests "
                "already in flight finish. Closing a closed or expired session returns "
                "it unchanged.",
                "security": secured,
                "parameters": [session_path],
                "responses": {
                    "200": _json_body(_ref("Session"), "The session, closed."),
                    "401": unauthorized,
                    "404": session_not_found,
                },
            },
        },
        "/v1/trees/{root}": {
            "get": {
                "operationId": "getTree",
                "summary": "The lineage tree a session belongs to",
                "description": "The tree from its root, whichever of its sessions is named. At most "
                f"{MAX_NODES} sessions are shown, nested at most {MAX_DEPTH} levels below the "
                "root; a node whose descendants were cut carries `omitted`, one whose children "
                "were read only in part (more than 1,000, shared store) `truncated`. The tree may "
                "change while the view is built: it is then a slightly inconsistent snapshot.",
                "security": secured,
                "parameters": [
                    {
                        "name": "root",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string", "minLength": 1, "maxLength": 256},
                    }
                ],
                "responses": {
                    "200": _json_body(_ref("TreeNode"), "The tree, nested."),
                    "401": unauthorized,
                    "404": _error("Unknown, or not visible to the caller (`tree_not_found`)."),
                },
            },
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "session-sidecar admin API",
            "version": __version__,
            "description": "Health, readiness, metrics, and the deployment-scoped sessions API. "
            "`/v1/*` needs a bearer token when `admin_tokens_file` is set.",
        },
        "paths": paths,
        "components": {
            "schemas": _schemas(config),
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }
