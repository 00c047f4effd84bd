"""Dynamo's ``nvext.session_control`` for the ``dynamo_nvext`` mode (:mod:`sidecar.modes.dynamo`):
the object a turn sends and its merge into a request body. Its own module so the compiled build
can type it (``nvext.pxd``): the mode runs it once per request."""

from __future__ import annotations

from typing import Any

from sidecar.modes.context import RoutingContext
from sidecar.modes.ids import DYNAMO_ALWAYS_FITS, DYNAMO_MAX_ID_BYTES, fit_id

NVEXT = "nvext"
SESSION_CONTROL = "session_control"
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


def with_control(body: dict[str, Any], control: dict[str, Any]) -> dict[str, Any]:
    """``body`` with ``control`` (a fresh dict) as its ``nvext.session_control``, merged over the
    keys the client's own session_control has beyond the owned ones. Copy-on-write: shallow copies
    of the dicts on the path to session_control only; ``body`` is not modified."""
    nvext = body.get(NVEXT)
    out = dict(body)
    if nvext is None:  # the usual request: nothing to merge
        out[NVEXT] = {SESSION_CONTROL: control}
        return out
    nvext = dict(nvext) if isinstance(nvext, dict) else {}
    old = nvext.get(SESSION_CONTROL)
    merged = {k: v for k, v in old.items() if k not in _OWNED_KEYS} if isinstance(old, dict) else {}
    merged.update(control)
    nvext[SESSION_CONTROL] = merged
    out[NVEXT] = nvext
    return out
