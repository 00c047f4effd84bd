"""Option field types shared by the built-in modes.

Values arrive as YAML scalars, ``--mode-opt key=value`` strings or ``SIDECAR_MODE_OPTS`` items,
so every type here coerces strings and canonicalizes (``" Tree "`` -> ``"tree"``,
``"123"`` -> ``123``) and rejects what would only be a typo (``true`` as a number of seconds).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field

from sidecar import headers as h
from sidecar.modes import base
from sidecar.validation import check_token


def canonical_word(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def _no_bool(value: Any) -> Any:
    # YAML `timeout_seconds: yes` is a bool, which pydantic would otherwise read as 1.
    if isinstance(value, bool):
        raise ValueError(f"must be an integer, not a boolean (got {value!r})")
    return value


def header_name(value: str) -> str:
    """An RFC 9110 token that the proxy does not manage itself."""
    if not value:
        raise ValueError("header name must not be empty")
    check_token(value)
    if value.lower() in h.PROXY_OWNED:
        raise ValueError(f"{value!r} is managed by the proxy and cannot be set by a mode")
    return value


Scope = Annotated[Literal["session", "tree"], BeforeValidator(canonical_word)]
Seconds = Annotated[int, BeforeValidator(_no_bool), Field(ge=1)]
HeaderName = Annotated[
    str, BeforeValidator(lambda v: v.strip() if isinstance(v, str) else v), AfterValidator(header_name)
]


class Scoped(base.ScopedOptions):
    """``scope: session`` keys on the session id, ``scope: tree`` on its tree's root id."""

    scope: Scope = Field("session", description="session: key on the session id; tree: on the root id")
