"""Structured JSON logs: one line per event on stderr."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

# LogRecord attributes that are not user-supplied `extra` fields.
_STD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys()) | {"message", "asctime", "taskName"}
# Never log these even if a caller passes them.
_REDACT = frozenset({"token", "authorization", "body"})


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra}`` as one JSON line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STD and key not in _REDACT:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def setup(level: str) -> None:
    """Configure the root logger once for the process."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's access log is one line per request with client addresses: off; our own metrics cover it.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
