"""The records a request's session and a session's end are described by: what the lineage tree
computes, the router hands to modes, and the shared store persists (a session's state bits,
:class:`SessionFlag`, included); and the body patch a mode hands back. A leaf: imports nothing of the sidecar, so modes (and third-party modes, through
:mod:`sidecar.modes.base`) depend on it alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntFlag, StrEnum
from typing import Any


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


# Not frozen, no slots=True: as RoutingContext (compiled, context.pxd, an extension type with
# fixed fields, built once per rewritten request and read as struct fields by the router).
@dataclass
class BodyPatch:
    """A change to a JSON object request body, applied to the client's bytes. Read-only once
    returned.

    The object at ``path`` (keys from the top level down) is made to contain ``values``:

    - objects missing on the path are created; a value on the path that is not an object is
      replaced by one;
    - a key the client repeats on the path: its last occurrence is the one followed (the one
      JSON parsers keep), the earlier ones are removed, so the upstream sees the key once;
    - in the object at ``path``, the client's members named in ``owned`` or in ``values`` are
      removed, every occurrence, and ``values`` are appended after the members left, serialized
      compactly as orjson does;
    - every other byte of the body (numbers, key order, duplicate keys, whitespace, string
      escapes) reaches the upstream exactly as the client sent it.

    ``path`` is a non-empty tuple of string keys, ``values`` a dict with string keys; ``owned``
    and ``values`` name at most 16 keys together.
    """

    path: tuple[str, ...]
    values: dict[str, Any]
    owned: tuple[str, ...] = ()


class SessionFlag(IntFlag):
    """A session's state bits: the session tree's nodes (``SessionNode.flags``, sidecar.lineage)
    and the ``f`` field of its record in a shared store, which the store's scripts read and
    write (sidecar.state.scripts) with these same values. The first five mean the same in both
    places; ``API`` is the store's only, ``CONFLICT`` and ``DETACHED`` the tree's only."""

    PLACEHOLDER = 1  # named by a child or a root hint, never sent a request itself
    FINAL_SEEN = 2  # a final turn has begun
    CLOSED = 4  # closed (through the API, or elsewhere); in the tree its id was tombstoned then
    ENDED = 8
    HINTED = 16  # placed under its tree's root by a root hint; has no declared parent
    API = 32  # created through the sessions API (a store record's)
    CONFLICT = 64  # a root-hint conflict was already counted for this session (the tree's)
    # closed and draining, its place taken by a newer session of its id: in no child list and
    # childless; ``parent`` is kept only to report it when it ends (the tree's)
    DETACHED = 128
