"""Checks shared by the configuration, the routing modes (built-in and third-party) and the
tokens file: a leaf module, importing nothing of the sidecar."""

from __future__ import annotations

import re
from typing import Any

import yaml

__all__ = ["TOKEN_RE", "check_token", "split_names", "yaml_error_where", "yaml_problem"]

# RFC 9110 field-name token.
TOKEN_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


def split_names(value: Any) -> Any:
    """Accept a list of names or one comma-separated string; strip each name."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()] if value.strip() else []
    if isinstance(value, (list, tuple)):
        return [v.strip() if isinstance(v, str) else v for v in value]
    return value


def check_token(name: str) -> str:
    """An RFC 9110 field-name token."""
    if not name or not TOKEN_RE.match(name):
        raise ValueError(f"{name!r} is not a valid header name (RFC 9110 token)")
    return name


def yaml_error_where(exc: yaml.YAMLError) -> str:
    """``", line 3, column 7"`` for a YAML error that knows its position (1-based), else ``""``."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    return f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong, without the excerpt of the file PyYAML quotes (it may hold a secret)."""
    parts = [p for p in (getattr(exc, "context", None), getattr(exc, "problem", None)) if p]
    return ", ".join(parts) if parts else type(exc).__name__
