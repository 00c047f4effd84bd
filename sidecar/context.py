"""The records a request's session and a session's end are described by: what the lineage tree
computes, the router hands to modes, and the shared store persists. A leaf: imports nothing of
the sidecar, so modes (and third-party modes, through :mod:`sidecar.modes.base`) depend on it
alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class EndReason(StrEnum):
    """Why a session ended; a closed set, usable as a metric label."""

    FINAL_TURN_COMPLETED = "final_turn_completed"
    FINAL_TURN_FAILED = "final_turn_failed"
    CLIENT_ABANDONED = "client_abandoned"
    API_CLOSED = "api_closed"
    IDLE_EXPIRED = "idle_expired"
    EVICTED = "evicted"
    SHUTDOWN = "shutdown"


class TurnOutcome(StrEnum):
    """How one proxied request (a turn) finished."""

    COMPLETED = "completed"
    UPSTREAM_FAILED = "upstream_failed"
    CLIENT_ABORTED = "client_aborted"


# Not frozen (a frozen dataclass costs more per construction, once per request of a session):
# every reader treats it as read-only. No slots=True: compiled (context.pxd), it is an extension
# type with fixed fields.
@dataclass
class RoutingContext:
    """What the sidecar knows about one request's session, computed by
    :meth:`sidecar.lineage.SessionTree.begin` and handed to the mode's hooks. Read-only.

    ``is_parent_final`` is None for roots and when the parent is a placeholder, otherwise True
    once the parent ended, was closed or has begun its final turn. ``is_tree_final`` is True only
    for a final turn that is the only request in flight in its tree while every other session of
    the tree has ended. ``turn`` is this session's 1-based request index; ``deployment`` the one
    the session is bound to.
    """

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


@dataclass(frozen=True, slots=True)
class SessionEnd:
    """The end of one session, emitted exactly once per real session (fleet-wide, with a shared
    store). ``reason`` compares equal to its string value."""

    session: str
    parent: str | None
    root: str
    deployment: str
    reason: EndReason
    turns: int
