"""JSON error responses with a stable ``type`` (the contract clients and tests rely on)."""

from __future__ import annotations

import os
import socket
import ssl
from typing import Any

import orjson

# Stable error types -> HTTP status.
UPSTREAM_UNREACHABLE = "upstream_unreachable"
UPSTREAM_TIMEOUT = "upstream_timeout"
UPSTREAM_PROTOCOL_ERROR = "upstream_protocol_error"
REQUEST_TOO_LARGE = "request_too_large"
BAD_REQUEST = "bad_request"
INVALID_JSON_BODY = "invalid_json_body"
JSON_TOO_DEEP = "json_too_deep"
MODE_ERROR = "mode_error"
UPGRADE_NOT_SUPPORTED = "upgrade_not_supported"
HEADERS_TOO_LARGE = "headers_too_large"
REQUEST_TIMEOUT = "request_timeout"
INTERNAL_ERROR = "internal_error"
# Deployment selection and API sessions on the request path.
UNKNOWN_DEPLOYMENT = "unknown_deployment"
DEPLOYMENT_CONFLICT = "deployment_conflict"
SESSION_REQUIRED = "session_required"
SESSION_NOT_FOUND = "session_not_found"
SESSION_CLOSED = "session_closed"
SESSION_EXPIRED = "session_expired"
# Sessions API.
INVALID_REQUEST = "invalid_request"
UNAUTHORIZED = "unauthorized"
FORBIDDEN = "forbidden"
SESSION_EXISTS = "session_exists"
SESSION_LIMIT_REACHED = "session_limit_reached"
TREE_NOT_FOUND = "tree_not_found"
PARENT_NOT_FOUND = "parent_not_found"
NOT_FOUND = "not_found"
METHOD_NOT_ALLOWED = "method_not_allowed"
STORE_UNAVAILABLE = "store_unavailable"

STATUS: dict[str, int] = {
    UPSTREAM_UNREACHABLE: 502,
    UPSTREAM_PROTOCOL_ERROR: 502,
    UPSTREAM_TIMEOUT: 504,
    REQUEST_TOO_LARGE: 413,
    BAD_REQUEST: 400,
    INVALID_JSON_BODY: 400,
    JSON_TOO_DEEP: 400,
    MODE_ERROR: 500,
    UPGRADE_NOT_SUPPORTED: 501,
    HEADERS_TOO_LARGE: 431,
    REQUEST_TIMEOUT: 408,
    INTERNAL_ERROR: 500,
    UNKNOWN_DEPLOYMENT: 400,
    DEPLOYMENT_CONFLICT: 409,
    SESSION_REQUIRED: 400,
    SESSION_NOT_FOUND: 404,
    SESSION_CLOSED: 410,
    SESSION_EXPIRED: 410,
    INVALID_REQUEST: 400,
    UNAUTHORIZED: 401,
    FORBIDDEN: 403,
    SESSION_EXISTS: 409,
    SESSION_LIMIT_REACHED: 429,
    TREE_NOT_FOUND: 404,
    PARENT_NOT_FOUND: 404,
    NOT_FOUND: 404,
    METHOD_NOT_ALLOWED: 405,
    STORE_UNAVAILABLE: 503,
}

# The error types the proxy listener answers itself: the closed set of
# `sidecar_rejected_requests_total{reason}` values besides the engines' own.
REQUEST_PATH_REJECTIONS = (
    UNKNOWN_DEPLOYMENT,
    DEPLOYMENT_CONFLICT,
    SESSION_REQUIRED,
    SESSION_NOT_FOUND,
    SESSION_CLOSED,
    SESSION_EXPIRED,
)


class ConfigError(Exception):
    """Invalid configuration; ``str()`` names each bad setting (the process refuses to start)."""


class ProxyError(Exception):
    """A request the sidecar answers itself, as ``{"error": {"type", "message", ...}}``."""

    def __init__(self, type_: str, message: str, *, status: int | None = None, **fields: Any) -> None:
        super().__init__(message)
        self.type = type_
        self.message = message
        self.status = status if status is not None else STATUS.get(type_, 500)
        self.fields = fields

    def body(self) -> bytes:
        """The JSON body of the error response."""
        err: dict[str, Any] = {"type": self.type, "message": self.message}
        err.update(self.fields)
        return orjson.dumps({"error": err})


def request_too_large(deployment: str, limit: int, parsed: bool = False) -> ProxyError:
    """413 for a body above ``limit`` bytes: ``limits.max_parsed_body_bytes`` when the sidecar
    reads the body as JSON (``parsed``), else ``limits.max_body_bytes``."""
    setting = "limits.max_parsed_body_bytes" if parsed else "limits.max_body_bytes"
    which = ", the limit for bodies the sidecar reads as JSON" if parsed else ""
    return ProxyError(
        REQUEST_TOO_LARGE,
        f"request body exceeds {limit} bytes{which} ({setting} of deployment {deployment!r})",
        deployment=deployment,
        limit=limit,
        setting=setting,
    )


def error_body(type_: str, message: str, **fields: Any) -> bytes:
    """JSON error body without raising (admin handlers)."""
    return ProxyError(type_, message, **fields).body()


# -- the errors both engines and the router answer with ------------------------------------------
# Client-facing bodies name the deployment and the upstream's index in its ``upstreams`` list,
# never a URL (it may carry credentials or internal addresses) and never the request's headers.


def headers_too_large(limit: int) -> ProxyError:
    return ProxyError(HEADERS_TOO_LARGE, f"request head exceeds {limit} bytes", limit=limit)


def bad_request(message: str) -> ProxyError:
    return ProxyError(BAD_REQUEST, message)


def unsupported_version(major: int, minor: int) -> ProxyError:
    """A request in an HTTP version the sidecar does not proxy: any but 1.0 and 1.1 (a request
    line without a version is HTTP/0.9, refused as soon as the line ends)."""
    return ProxyError(BAD_REQUEST, f"unsupported HTTP version {major}.{minor}")


def unsupported_transfer_coding() -> ProxyError:
    """A request framed by a transfer coding the sidecar cannot forward faithfully (RFC 9112 6.1,
    6.3): anything but a lone ``chunked``, or chunked on HTTP/1.0."""
    return ProxyError(BAD_REQUEST, "unsupported Transfer-Encoding (only chunked, on HTTP/1.1)")


def request_timeout(message: str) -> ProxyError:
    return ProxyError(REQUEST_TIMEOUT, message)


def upgrade_not_supported() -> ProxyError:
    return ProxyError(UPGRADE_NOT_SUPPORTED, "the sidecar does not proxy protocol upgrades")


def internal_error() -> ProxyError:
    return ProxyError(INTERNAL_ERROR, "the sidecar failed to handle this request")


def upstream_failed(kind: str, deployment: str, upstream: int, reason: str) -> ProxyError:
    """The answer to an upstream failure before its response began, by the failure's kind:
    ``timeout`` (504), ``connect`` (502: unreachable, nothing was sent), any other (502)."""
    where = f"upstream {upstream} of deployment {deployment!r}"
    if kind == "timeout":
        return ProxyError(UPSTREAM_TIMEOUT, f"{where} timed out", deployment=deployment, upstream=upstream)
    if kind == "connect":
        return ProxyError(
            UPSTREAM_UNREACHABLE, f"{where} is unreachable: {reason}", deployment=deployment, upstream=upstream
        )
    return ProxyError(UPSTREAM_PROTOCOL_ERROR, f"{where} failed: {reason}", deployment=deployment, upstream=upstream)


def failure_reason(exc: BaseException) -> str:
    """A short, client-safe reason for a failed upstream connection or exchange (no addresses,
    no request data): ``connection refused``, ``timed out``, ``TLS: CERTIFICATE_VERIFY_FAILED``..."""
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or type(exc).__name__}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, socket.gaierror):
        return f"name resolution failed: {exc.strerror}".lower()
    if isinstance(exc, OSError) and exc.errno:
        # The errno's text, not the exception's: asyncio's messages name the address.
        return os.strerror(exc.errno).lower()
    return type(exc).__name__
