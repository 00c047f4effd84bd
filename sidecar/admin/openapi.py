"""The OpenAPI 3.1 description of the admin listener, served at ``/openapi.json``."""

from __future__ import annotations

from typing import Any

from sidecar import __version__
from sidecar.admin.sessions_api import CURSOR_PATTERN, LIST_DEFAULT_LIMIT, LIST_MAX_LIMIT, SESSION_ID_PATTERN
from sidecar.admin.views import MAX_DEPTH, MAX_NODES
from sidecar.config import Config

_JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_body(schema: dict[str, Any], description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": {_JSON: {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    return _json_body(_ref("Error"), description, headers)


_UNAUTHORIZED = _error("No or invalid bearer token.",
                       {"WWW-Authenticate": {"schema": {"type": "string"}, "required": True}})
_SESSION_NOT_FOUND = _error("Unknown, or not visible to the caller (`session_not_found`).")
_TIMESTAMP = {"type": "string", "format": "date-time"}
_NULLABLE_TIMESTAMP = {"type": ["string", "null"], "format": "date-time"}


def build_openapi(config: Config, *, authenticated: bool) -> dict[str, Any]:
    """The document for this configuration (limits and deployment names filled in);
    ``authenticated``: whether ``/v1/*`` requires a bearer token (a tokens file is set)."""
    api = config.sessions.api
    deployments = [d.name for d in config.resolved_deployments()]
    session_path = {"name": "session_id", "in": "path", "required": True,
                    "schema": {"type": "string", "minLength": 1, "maxLength": 256}}
    secured: list[dict[str, list[str]]] = [{"bearerAuth": []}] if authenticated else []
    schemas: dict[str, Any] = {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": {"type": "string", "description": "stable machine-readable type"},
                               "message": {"type": "string"}},
                "additionalProperties": True,
            }},
        },
        "SessionCreate": {
            "type": "object",
            "required": ["deployment"],
            "additionalProperties": False,
            "properties": {
                "deployment": {"type": "string", "enum": deployments,
                               "description": "the deployment to bind the session to"},
                "session_id": {"type": "string", "pattern": SESSION_ID_PATTERN,
                               "description": "default: a generated UUID. A workspace token chooses ids in its "
                                              "own namespace only: `<workspace>:` and at least one more "
                                              "character (any other id is refused with 400 `invalid_request`, "
                                              "whether or not it exists); admin tokens and an open API choose "
                                              "any id"},
                "ttl_seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": api.max_ttl_seconds,
                                "description": "expire after this long without a request (default "
                                               f"{api.default_ttl_seconds})"},
                "parent": {"type": "string", "pattern": SESSION_ID_PATTERN,
                           "description": "an active session of the same deployment you created"},
            },
        },
        "Session": {
            "type": "object",
            "required": ["id", "deployment", "workspace", "status", "origin", "parent", "ttl_seconds",
                         "created_at", "last_active_at", "expires_at", "ended_at", "root", "turns",
                         "in_flight", "final_turn_seen"],
            "properties": {
                "id": {"type": "string"},
                "deployment": {"type": "string"},
                "workspace": {"type": ["string", "null"]},
                "status": {"type": "string", "enum": ["active", "closed", "expired"]},
                "origin": {"type": "string", "enum": ["api", "traffic"],
                           "description": "created through this API, or learned from request headers "
                                          "(visible to admin tokens only)"},
                "parent": {"type": ["string", "null"]},
                "ttl_seconds": {"type": ["number", "null"]},
                "created_at": _TIMESTAMP,
                "last_active_at": _NULLABLE_TIMESTAMP,
                "expires_at": _NULLABLE_TIMESTAMP,
                "ended_at": _NULLABLE_TIMESTAMP,
                "root": {"type": ["string", "null"], "description": "root of its lineage tree, once it had a request"},
                "turns": {"type": "integer", "minimum": 0},
                "in_flight": {"type": "integer", "minimum": 0},
                "final_turn_seen": {"type": "boolean"},
                "placeholder": {"type": "boolean"},
                "end_reason": {"type": ["string", "null"]},
                "workers": _ref("WorkerRuns"),
                "affinity": _ref("Affinity"),
            },
        },
        "WorkerRuns": {
            "type": "array",
            "description": "which upstream worker served the session's turns, as runs of consecutive turns "
                           "on one worker, oldest first (the last 8 runs)",
            "items": {"type": "object", "required": ["worker", "turns"],
                      "properties": {"worker": {"type": "string"}, "turns": {"type": "integer", "minimum": 1}}},
        },
        "Affinity": {
            "type": "object",
            "description": "turns by worker outcome: first, same_worker (as the previous turn), moved",
            "required": ["first", "same_worker", "moved"],
            "properties": {k: {"type": "integer", "minimum": 0} for k in ("first", "same_worker", "moved")},
        },
        "SessionList": {
            "type": "object",
            "required": ["data", "next_cursor"],
            "properties": {"data": {"type": "array", "items": _ref("Session")},
                           "next_cursor": {"type": ["string", "null"],
                                           "description": "pass as `cursor` for the next page; null on the last"}},
        },
        "TreeNode": {
            "type": "object",
            "required": ["session", "parent", "root", "deployment", "turns", "in_flight", "ended", "children"],
            "properties": {
                "session": {"type": "string"},
                "parent": {"type": ["string", "null"]},
                "root": {"type": "string"},
                "deployment": {"type": "string"},
                "created_at": _TIMESTAMP,
                "last_active_at": _TIMESTAMP,
                "turns": {"type": "integer"},
                "in_flight": {"type": "integer"},
                "final_turn_seen": {"type": "boolean"},
                "ended": {"type": "boolean"},
                "end_reason": {"type": ["string", "null"]},
                "closed": {"type": "boolean"},
                "placeholder": {"type": "boolean"},
                "workers": _ref("WorkerRuns"),
                "affinity": _ref("Affinity"),
                "children": {"type": "array", "items": _ref("TreeNode"),
                             "description": "oldest first; cut by the view's bounds (see `omitted`)"},
                "omitted": {"type": "integer", "minimum": 0,
                            "description": "present when the view cut sessions below this node: how many "
                                           "are not shown"},
            },
        },
        "Status": {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}},
    }
    paths: dict[str, Any] = {
        "/healthz": {"get": {"operationId": "healthz", "summary": "Liveness", "security": [],
                             "responses": {"200": _json_body(_ref("Status"), "Alive.")}}},
        "/readyz": {"get": {"operationId": "readyz", "summary": "Readiness", "security": [],
                            "responses": {"200": _json_body(_ref("Status"), "Ready."),
                                          "503": _json_body(_ref("Status"), "Not ready or draining.")}}},
        "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus metrics", "security": [],
                             "responses": {"200": {"description": "Prometheus text format.",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/openapi.json": {"get": {"operationId": "openapi", "summary": "This document", "security": [],
                                  "responses": {"200": _json_body({"type": "object"}, "OpenAPI 3.1 document.")}}},
        "/v1/sessions": {
            "post": {
                "operationId": "createSession",
                "summary": "Create a session bound to a deployment",
                "security": secured,
                "requestBody": {"required": True, "content": {_JSON: {"schema": _ref("SessionCreate")}}},
                "responses": {
                    "201": _json_body(_ref("Session"), "Created.",
                                      {"Location": {"schema": {"type": "string"}, "required": True}}),
                    "400": _error("Invalid body, or a `session_id` outside the workspace token's namespace "
                                  "(`invalid_request`), or unknown deployment (`unknown_deployment`)."),
                    "401": _UNAUTHORIZED,
                    "404": _error("`parent` names no active session of the deployment that the caller "
                                  "created (`parent_not_found`)."),
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
                    {"name": "status", "in": "query", "required": False,
                     "schema": {"type": "string", "enum": ["active", "closed", "expired"]}},
                    {"name": "limit", "in": "query", "required": False,
                     "schema": {"type": "integer", "minimum": 1, "maximum": LIST_MAX_LIMIT,
                                "default": LIST_DEFAULT_LIMIT}},
                    {"name": "cursor", "in": "query", "required": False,
                     "description": "the `next_cursor` of the previous page (opaque)",
                     "schema": {"type": "string", "pattern": CURSOR_PATTERN}},
                ],
                "responses": {
                    "200": _json_body(_ref("SessionList"), "One page."),
                    "400": _error("Invalid parameter (`invalid_request`)."),
                    "401": _UNAUTHORIZED,
                },
            },
        },
        "/v1/sessions/{session_id}": {
            "get": {
                "operationId": "getSession",
                "summary": "One session with its lineage facts",
                "security": secured,
                "parameters": [session_path],
                "responses": {"200": _json_body(_ref("Session"), "The session."),
                              "401": _UNAUTHORIZED,
                              "404": _SESSION_NOT_FOUND},
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
                "responses": {"200": _json_body(_ref("Session"), "The session, closed."),
                              "401": _UNAUTHORIZED,
                              "404": _SESSION_NOT_FOUND},
            },
        },
        "/v1/trees/{root}": {
            "get": {
                "operationId": "getTree",
                "summary": "The lineage tree a session belongs to",
                "description": "The tree from its root, whichever of its sessions is named. At most "
                               f"{MAX_NODES} sessions are shown, nested at most {MAX_DEPTH} levels below the "
                               "root; a node whose descendants were cut carries `omitted`. The tree may "
                               "change while the view is built: it is then a slightly inconsistent snapshot.",
                "security": secured,
                "parameters": [{"name": "root", "in": "path", "required": True,
                                "schema": {"type": "string", "minLength": 1, "maxLength": 256}}],
                "responses": {"200": _json_body(_ref("TreeNode"), "The tree, nested."),
                              "401": _UNAUTHORIZED,
                              "404": _error("Unknown, or not visible to the caller (`tree_not_found`).")},
            },
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "session-sidecar admin API", "version": __version__,
                 "description": "Health, readiness, metrics, and the deployment-scoped sessions API. "
                                "`/v1/*` needs a bearer token when `admin_tokens_file` is set."},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }
