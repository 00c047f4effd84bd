"""The routing context a mode's hooks receive (re-exported by :mod:`sidecar.modes.base`, the
plugin contract). Its own module so the compiled build can make it an extension type: the
router builds one per request of a session."""

from __future__ import annotations

from dataclasses import dataclass


# Not frozen (a frozen dataclass costs ~1.5 us per construction, once per request): modes must
# treat it as read-only, like every hook input. No slots=True: compiled (context.pxd), it is an
# extension type with fixed fields.
@dataclass
class RoutingContext:
    """What the sidecar knows about one request's session (SPEC section 3). Read-only."""

    session: str
    parent: str | None
    root: str
    is_final_turn: bool
    is_parent_final: bool | None
    is_tree_final: bool
    turn: int
    deployment: str
    # What this mode's on_response last returned for the session (e.g. a gateway's session token).
    mode_state: str | None = None
