"""Gateway-neutral header modes, for routers keyed on a header of your choice.

``session_id_header`` emits ``<header_name>: <id>``; options ``header_name`` (an RFC 9110 token,
default ``X-Session-ID``: vllm-router's consistent-hash key) and ``scope`` (``session`` or
``tree``: the id is the session's or its tree's root).

``identity_headers`` emits each configured header with its tier's id: names under ``session``
carry the session id, under ``parent`` the parent id (omitted for roots), under ``root`` the
root id. Each tier is a list of names or one comma-separated string; at least one name in all,
each an RFC 9110 token, no name twice across the tiers (case-insensitively).

Neither mode touches the body, and neither shortens ids: size limits are the target's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from sidecar import headers as h
from sidecar.modes.base import Mode, RoutingContext
from sidecar.modes.options import HeaderName, Scoped
from sidecar.validation import split_names


class SessionIdHeaderOptions(Scoped):
    header_name: HeaderName = Field(h.X_SESSION_ID, description="header carrying the id (RFC 9110 token)")


class SessionIdHeader(Mode):
    """<header_name>: <session or root id> (vllm-router, production-stack, custom routers)."""

    name = "session_id_header"
    Options = SessionIdHeaderOptions
    options: SessionIdHeaderOptions

    def emitted_headers(self) -> Sequence[str]:
        return (self.options.header_name,)

    def request_headers(self, ctx: RoutingContext) -> Sequence[tuple[str, str]]:
        o = self.options
        return ((o.header_name, ctx.root if o.scope == "tree" else ctx.session),)


HeaderNames = Annotated[list[HeaderName], BeforeValidator(split_names)]
_TIERS = ("session", "parent", "root")


class IdentityHeadersOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    session: HeaderNames = Field(default_factory=list, description="headers carrying the session id")
    parent: HeaderNames = Field(default_factory=list, description="headers carrying the parent id (children only)")
    # validate_default: the "at least one name" rule must run even when `root` is not given.
    root: HeaderNames = Field(default_factory=list, validate_default=True, description="headers carrying the root id")

    @field_validator("session", "parent", "root")
    @classmethod
    def _unique(cls, names: list[str], info: ValidationInfo) -> list[str]:
        # Tiers validate in declaration order, so earlier (valid) tiers are in info.data.
        seen: dict[str, str] = {}
        for tier in _TIERS[: _TIERS.index(str(info.field_name))]:
            for n in info.data.get(tier, ()):
                seen[n.lower()] = tier
        for n in names:
            other = seen.get(n.lower())
            if other is not None:
                where = "twice" if other == info.field_name else f"in both {other} and {info.field_name}"
                raise ValueError(f"header {n!r} is named {where} (names are unique case-insensitively across tiers)")
            seen[n.lower()] = str(info.field_name)
        if info.field_name == "root" and not seen and all(t in info.data for t in _TIERS[:2]):
            raise ValueError("no header names: give at least one in session, parent or root")
        return names


class IdentityHeaders(Mode):
    """Session, parent and root ids each in headers of your choice."""

    name = "identity_headers"
    Options = IdentityHeadersOptions
    options: IdentityHeadersOptions

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        o = self.options
        self._emits = (*o.session, *o.parent, *o.root)

    def emitted_headers(self) -> Sequence[str]:
        return self._emits

    def request_headers(self, ctx: RoutingContext) -> Sequence[tuple[str, str]]:
        o = self.options
        out = [(n, ctx.session) for n in o.session]
        if ctx.parent is not None:
            out += [(n, ctx.parent) for n in o.parent]
        out += [(n, ctx.root) for n in o.root]
        return out
