"""Session state beyond one process: the interface the router and the engines use, and the
memory backend (nothing shared: the default, today's single-process behaviour).

With a shared backend (:mod:`sidecar.state.redis`) the router's session tree and API-session
table are this replica's cache of the store: a request of a session the cache does not hold
raises :class:`LoadNeeded` from :meth:`sidecar.router.Router.route`; the engine awaits
:meth:`SessionState.load` (one pipelined round trip, shared by every request waiting in the same
loop iteration) and routes again. Everything else on the request path is synchronous and costs no
round trip: the router reports turns to the backend (:meth:`SessionState.begun`,
:meth:`SessionState.finished`, :meth:`SessionState.touched`), which writes them behind, batched.
Ends are claimed in the store, exactly once across the fleet, and handed back through
``on_claimed``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sidecar.context import SessionEnd
    from sidecar.identity import Identity
    from sidecar.lineage import Turn

__all__ = ["LoadNeeded", "MemoryState", "SessionState", "StoreUnavailable"]


class LoadNeeded(Exception):
    """The request names a session this replica does not hold: load it from the store first.

    ``resume``, when given, continues where the router stopped (a body's admission); without it
    the engine routes the request again."""

    def __init__(self, identity: Identity, resume: Callable[[], Any] | None = None) -> None:
        super().__init__(identity.session)
        self.identity = identity
        self.resume = resume


class StoreUnavailable(Exception):
    """The shared store cannot answer now (its breaker is open or the call failed), or, at start
    with ``state.required``, could not be used."""


class SessionState:
    """Where sessions live beyond this process. This base class is the memory backend: every
    session lives in the router's tree and table only, every local end is the end."""

    # Whether sessions are shared with other replicas (the router then reports to this object).
    shared = False

    def __init__(self) -> None:
        # Set by the app: runs the end-of-session actions of a session this replica claimed, and
        # calls its second argument once they ran (the claim is then confirmed in the store).
        self.on_claimed: Callable[[SessionEnd, Callable[[], None]], None] | None = None
        # Set by the app: another replica started closing a session (id, reason).
        self.on_closing: Callable[[str, str], None] | None = None

    async def start(self) -> None:
        """Connect (a shared backend); raises when the store is required and unreachable."""

    async def stop(self) -> None:
        """Write what is pending and release the store (after the drain)."""

    async def load(self, identity: Identity) -> None:
        """Bring the session of ``identity`` (and its parent or root hint) into this replica's
        cache; returns when done, or at once when the store is unavailable (routing then goes on
        with what this replica knows)."""

    def begun(self, turn: Turn) -> None:
        """A turn of the session began here (its first one: the session is new)."""

    def finished(self, turn: Turn) -> None:
        """A turn ended here."""

    def touched(self, turn: Turn, *, mode_state: bool = False) -> None:
        """The session's worker history, or its mode state, changed."""

    def local_ends(self, ended: Sequence[SessionEnd]) -> Sequence[SessionEnd]:
        """Sessions that ended here (the local tree's events). Returns the ones whose
        end-of-session actions run now; a shared backend claims them first (exactly once across
        the fleet) and hands them to ``on_claimed`` later."""
        return ended

    def stats(self) -> dict[str, Any]:
        """Counters for metrics (empty for the memory backend)."""
        return {}


class MemoryState(SessionState):
    """Sessions in this process only (``state.url: memory://``)."""
