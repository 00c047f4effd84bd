"""JSON error responses with a stable ``type`` (the contract clients and tests rely on)."""

from __future__ import annotations

from typing import Any

import orjson

# Stable error types -> HTTP status.
UPSTREAM_UNREACHABLE = "upstream_unreachable"
UPSTREAM_TIMEOUT = "upstream_timeout"
UPSTREAM_PROTOCOL_ERROR = "upstream_protocol_error"
REQUEST_TOO_LARGE = "request_too_large"
BAD_REQUEST = "bad_request"
INVALID_JSON_BODY = "invalid_json_body"
MODE_ERROR = "mode_error"
UPGRADE_NOT_SUPPORTED = "upgrade_not_supported"
SHUTTING_DOWN = "shutting_down"

STATUS: dict[str, int] = {
    UPSTREAM_UNREACHABLE: 502,
    UPSTREAM_PROTOCOL_ERROR: 502,
    UPSTREAM_TIMEOUT: 504,
    REQUEST_TOO_LARGE: 413,
    BAD_REQUEST: 400,
    INVALID_JSON_BODY: 400,
    MODE_ERROR: 500,
    UPGRADE_NOT_SUPPORTED: 501,
    SHUTTING_DOWN: 503,
}


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


def error_body(type_: str, message: str, **fields: Any) -> bytes:
    """JSON error body without raising (admin handlers)."""
    return ProxyError(type_, message, **fields).body()
