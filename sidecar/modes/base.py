"""The routing-mode plugin contract.

A mode turns a request's routing context into what the target gateway understands. Hooks are
synchronous and pure: they never perform I/O and never mutate their inputs. Anything that needs
I/O (e.g. telling a router that a session finished) is returned as an :class:`EndAction` that the
proxy layer executes.

A mode declares its cost up front: only modes with ``mutates_body = True`` change request
bodies, and only for them does the proxy buffer and scan request bodies. Such a mode implements
exactly one of two hooks: :meth:`Mode.body_patch` (declarative: the proxy splices the change into
the client's bytes, everything else reaches the upstream byte for byte) or
:meth:`Mode.transform_body` (a parsed dict in, a dict out, re-serialized).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from sidecar.context import BodyPatch as BodyPatch  # the contract: what modes receive and return
from sidecar.context import EndReason as EndReason
from sidecar.context import RoutingContext as RoutingContext
from sidecar.context import SessionEnd as SessionEnd


@dataclass(frozen=True, slots=True)
class EndAction:
    """An HTTP call the proxy layer makes to the deployment's upstream after a session ended."""

    method: str
    path: str
    query: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None


class NoOptions(BaseModel):
    """Options model of a mode that takes none: every key is rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ScopedOptions(BaseModel):
    """Options of modes that key on either the session or the whole tree."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    scope: Literal["session", "tree"] = "session"


class ModeContractError(TypeError):
    """A mode class breaks the plugin contract (refused at startup)."""


class Mode:
    """Base class of every routing mode.

    Subclasses set ``name``, optionally ``Options`` (a pydantic model with ``extra="forbid"``)
    and ``mutates_body``, and override the hooks they need.
    """

    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]] = NoOptions
    mutates_body: ClassVar[bool] = False

    def __init__(self, options: BaseModel) -> None:
        self.options = options

    @classmethod
    def from_options(cls, raw: dict[str, Any]) -> Mode:
        """Validate raw options (raises pydantic ``ValidationError``) and build the mode."""
        return cls(cls.Options.model_validate(raw))

    def notice(self) -> str | None:
        """A line the sidecar logs at warning when it starts, once for each deployment in this
        mode: what the gateway must be for the mode to work (versions, flags); None: nothing."""
        return None

    def emitted_headers(self) -> Sequence[str]:
        """Header names this mode sets; client-supplied copies are removed first unless trusted."""
        return ()

    def request_headers(self, ctx: RoutingContext) -> Sequence[tuple[str, str]]:
        """Headers to add to a request of a known session. Runs once per request, before forwarding."""
        return ()

    def body_patch(self, ctx: RoutingContext) -> BodyPatch | None:
        """What to change in the request body (see :class:`BodyPatch`), or None to forward it
        unchanged. Runs once per request whose body is a JSON object, on the event loop, for
        modes with ``mutates_body = True``; the proxy applies the patch to the client's bytes.
        """
        return None

    def transform_body(self, ctx: RoutingContext, body: dict[str, Any]) -> dict[str, Any]:
        """Return the body to forward (a new object: ``body`` must not be mutated).

        For modes with ``mutates_body = True`` that need more than :meth:`body_patch`. Runs for
        bodies that are a JSON object within the deployment's parse limits, parsed by orjson;
        the result is serialized by orjson, so what the mode did not touch may still change
        (integers beyond 64 bits become floats, duplicate keys collapse, spacing and escapes are
        normalized). May run on a worker thread (for large bodies): it must be pure. A result
        orjson cannot serialize (e.g. nested deeper than 254) is a failure of the mode.
        """
        return body

    def on_response(self, ctx: RoutingContext, headers: Mapping[str, str]) -> str | None:
        """Runs when the upstream's response head arrives (``headers``: lower-case name lookup).

        Return a new per-session state string to remember (it is bounded with the session and
        handed back as ``ctx.mode_state`` on the session's later requests), or None to keep it.
        """
        return None

    def on_session_end(self, end: SessionEnd) -> Sequence[EndAction]:
        """Runs once per ended session, after its last proxied byte; returns I/O for the proxy."""
        return ()


def check_contract(cls: type) -> type[Mode]:
    """Refuse a mode class whose declarations contradict its hooks."""
    if not (isinstance(cls, type) and issubclass(cls, Mode)):
        raise ModeContractError(f"{cls!r} is not a subclass of sidecar.modes.base.Mode")
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        raise ModeContractError(f"{cls.__qualname__} has no `name`")
    hooks = [hook for hook in ("body_patch", "transform_body") if getattr(cls, hook) is not getattr(Mode, hook)]
    if hooks and not cls.mutates_body:
        raise ModeContractError(f"mode {cls.name!r} overrides {hooks[0]} but does not declare mutates_body = True")
    if cls.mutates_body and not hooks:
        raise ModeContractError(
            f"mode {cls.name!r} declares mutates_body = True but does not override body_patch or transform_body"
        )
    if len(hooks) > 1:
        raise ModeContractError(f"mode {cls.name!r} overrides both body_patch and transform_body: implement one")
    if not (isinstance(cls.Options, type) and issubclass(cls.Options, BaseModel)):
        raise ModeContractError(f"mode {cls.name!r}: Options must be a pydantic model")
    if cls.Options.model_config.get("extra") != "forbid":
        raise ModeContractError(f"mode {cls.name!r}: Options must reject unknown keys (extra='forbid')")
    return cls
