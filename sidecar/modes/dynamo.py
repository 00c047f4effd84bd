"""NVIDIA Dynamo modes.

``dynamo_headers`` emits ``X-Dynamo-Session-ID: <session>`` and, only when the session has a
parent, ``X-Dynamo-Parent-Session-ID: <parent>``. No options. This is the mode for Dynamo 1.3.0
and later (run the frontend with ``--router-session-affinity-ttl-secs``).

``dynamo_nvext`` writes ``nvext.session_control`` into the JSON request body. Which Dynamo
releases accept what (each checked against the release's frontend on loopback):

- 1.1.x and 1.2.x have ``session_control`` with the actions ``open`` and ``close`` (and none, to
  continue a session); they answer ``bind`` with HTTP 400 (unknown variant). They apply it only
  for workers that serve sessions (SGLang started with ``--enable-streaming-session``); with
  other workers they accept it and log that session control is ignored.
- ``bind`` existed only in 1.3.0 development builds (and is AIPerf's convention for them).
- 1.3.0 and later have no ``session_control``: any request carrying it is answered HTTP 400
  (unknown field). Use ``dynamo_headers`` there.

Options: ``timeout_seconds`` (int >= 1, default 300), ``scope`` (``session`` or ``tree``),
``protocol``:

- ``open`` (default: what the releases accept): ``{"session_id", "action": "open", "timeout"}``
  on the session's first turn, ``{"session_id"}`` on middle turns, ``{"session_id", "action":
  "close"}`` on the final turn; a session whose first turn is also its last gets no
  ``session_control``.
- ``bind`` (1.3.0 development builds): ``{"session_id", "action": "bind", "timeout"}`` on every
  non-final turn, ``{"session_id", "action": "close"}`` on the final one.

With ``scope: tree`` the id is the tree's root and the close is sent only on the turn that makes
the whole tree final (``is_tree_final``); under ``open`` the tree is opened by the root's first turn.

The object goes in as a :class:`~sidecar.modes.base.BodyPatch` spliced into the client's bytes:
other ``nvext`` keys and other ``session_control`` keys are kept, the mode's keys
(``session_id``, ``action``, ``timeout``) are set or removed, a non-object ``nvext`` or
``session_control`` is replaced, and the rest of the body reaches Dynamo byte for byte.

Ids longer than Dynamo's 256-byte limit are fitted (:mod:`sidecar.modes.ids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from sidecar.context import BodyPatch, RoutingContext
from sidecar.headers import X_DYNAMO_PARENT_SESSION_ID, X_DYNAMO_SESSION_ID
from sidecar.modes.base import Mode
from sidecar.modes.ids import DYNAMO_ALWAYS_FITS, DYNAMO_MAX_ID_BYTES, fit_id
from sidecar.modes.options import Scoped, Seconds, canonical_word

NVEXT = "nvext"
SESSION_CONTROL = "session_control"
_PATH = (NVEXT, SESSION_CONTROL)
# The session_control keys the mode owns: set or removed on every request; any other key stays.
_OWNED_KEYS = ("session_id", "action", "timeout")


def session_control(tree: bool, bind: bool, timeout: int, ctx: RoutingContext) -> dict[str, Any] | None:
    """The ``session_control`` object for this request (``tree``: scope tree; ``bind``: protocol
    bind, else open), or None to send none."""
    sid = ctx.root if tree else ctx.session
    if len(sid) > DYNAMO_ALWAYS_FITS:
        sid = fit_id(sid, DYNAMO_MAX_ID_BYTES)
    final = ctx.is_tree_final if tree else ctx.is_final_turn
    if bind:
        if final:
            return {"session_id": sid, "action": "close"}
        return {"session_id": sid, "action": "bind", "timeout": timeout}
    opening = ctx.turn == 1 and (not tree or ctx.session == ctx.root)
    if final:
        # Nothing was opened for a one-turn session, so there is nothing to close.
        return None if opening else {"session_id": sid, "action": "close"}
    if opening:
        return {"session_id": sid, "action": "open", "timeout": timeout}
    return {"session_id": sid}


class DynamoHeaders(Mode):
    """Dynamo 1.3.0+: X-Dynamo-Session-ID (+ X-Dynamo-Parent-Session-ID for children)."""

    name = "dynamo_headers"
    _EMITS = (X_DYNAMO_SESSION_ID, X_DYNAMO_PARENT_SESSION_ID)

    def emitted_headers(self) -> Sequence[str]:
        return self._EMITS

    def request_headers(self, ctx: RoutingContext) -> Sequence[tuple[str, str]]:
        session = ctx.session
        if len(session) > DYNAMO_ALWAYS_FITS:  # runs once per request: no call for an id that fits
            session = fit_id(session, DYNAMO_MAX_ID_BYTES)
        if ctx.parent is None:
            return ((X_DYNAMO_SESSION_ID, session),)
        return (
            (X_DYNAMO_SESSION_ID, session),
            (X_DYNAMO_PARENT_SESSION_ID, fit_id(ctx.parent, DYNAMO_MAX_ID_BYTES)),
        )


class NvextOptions(Scoped):
    timeout_seconds: Seconds = Field(300, description="affinity timeout sent with open/bind, seconds >= 1")
    protocol: Annotated[Literal["open", "bind"], BeforeValidator(canonical_word)] = Field(
        "open",
        description="open: open / - / close, what Dynamo 1.1.x-1.2.x accept; bind: bind / close, accepted only by "
        "1.3.0 development builds",
    )


# Logged at start for each deployment in this mode (Mode.notice), by protocol.
_RELEASES = {
    "open": (
        "dynamo_nvext sends nvext.session_control open / close, which only Dynamo 1.1.x-1.2.x accept, and apply "
        "only for workers that serve sessions (SGLang with --enable-streaming-session); Dynamo 1.3.0 and later "
        "answer it with HTTP 400 (unknown field session_control): use dynamo_headers for them"
    ),
    "bind": (
        "dynamo_nvext sends nvext.session_control bind / close (protocol: bind), which only Dynamo 1.3.0 "
        "development builds accept; released Dynamo 1.1.x-1.2.x answer HTTP 400 (unknown variant bind: use "
        "protocol: open), 1.3.0 and later HTTP 400 (unknown field session_control: use dynamo_headers)"
    ),
}


class DynamoNvext(Mode):
    """Dynamo 1.1.x-1.2.x only: nvext.session_control open/close in the JSON body (bind: 1.3.0 dev builds only; 1.3.0 and later reject it: use dynamo_headers)."""  # noqa: E501

    name = "dynamo_nvext"
    Options = NvextOptions
    mutates_body = True
    options: NvextOptions

    def __init__(self, options: NvextOptions) -> None:
        super().__init__(options)
        # Read once per request: plain attributes, not pydantic field reads.
        self._tree = options.scope == "tree"
        self._bind = options.protocol == "bind"
        self._timeout = options.timeout_seconds

    def notice(self) -> str:
        return _RELEASES[self.options.protocol]

    def session_control(self, ctx: RoutingContext) -> dict[str, Any] | None:
        """The ``session_control`` object for this request, or None to send none."""
        return session_control(self._tree, self._bind, self._timeout, ctx)

    def body_patch(self, ctx: RoutingContext) -> BodyPatch | None:
        control = session_control(self._tree, self._bind, self._timeout, ctx)
        return None if control is None else BodyPatch(_PATH, control, _OWNED_KEYS)
