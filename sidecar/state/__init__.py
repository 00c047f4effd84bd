"""Session state beyond one process: the interface the router and the engines use, and the
memory backend (nothing shared: the default, today's single-process behaviour).

With a shared backend (:mod:`sidecar.state.redis`) the router's session tree and API-session
table are this replica's cache of the store: the admission of a request of a session the cache
does not hold needs LOAD (:class:`sidecar.router.Admission`); the engine awaits
:meth:`SessionState.load` (one pipelined round trip, shared by every request waiting in the same
loop iteration) and feeds ``loaded()``. Everything else on the request path is synchronous and costs no
round trip: the router reports turns to the backend (:meth:`SessionState.begun`,
:meth:`SessionState.finished`, :meth:`SessionState.touched`, :meth:`SessionState.used`), which
writes them behind, batched.
Ends are claimed in the store, exactly once across the fleet; the replica that claims one runs
it through the funnel every end goes through (:class:`sidecar.session_ends.SessionEnds`).

Responses API chaining (``identity.body: [previous_response_id]``) keeps which session produced
each response id (:class:`ResponseIds`, bounded in count and age): the router remembers it
(:meth:`SessionState.remember_response`) once the response's first bytes named it, and looks it
up (:meth:`SessionState.response_session`) when a request names it as its previous response.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sidecar.config import Config
    from sidecar.context import SessionEnd
    from sidecar.identity import Identity
    from sidecar.lineage import Turn
    from sidecar.session_ends import SessionEnds

__all__ = ["MemoryState", "ResponseIds", "SessionState", "StoreUnavailable"]


class ResponseIds:
    """Which session, of which deployment, produced each response id: at most ``max_ids``
    (the oldest forgotten first), each for at most ``ttl`` seconds (``sessions.response_ids_*``).
    O(1) per call: entries are kept in the order remembered."""

    __slots__ = ("max_ids", "ttl", "_clock", "_ids")

    def __init__(
        self, max_ids: int = 100_000, ttl: float = 3600.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_ids = max_ids
        self.ttl = ttl
        self._clock = clock
        self._ids: OrderedDict[str, tuple[str, str, float]] = OrderedDict()

    @classmethod
    def from_config(cls, config: Config) -> ResponseIds:
        s = config.sessions
        return cls(s.response_ids_max, s.response_ids_ttl_seconds)

    def remember(self, response_id: str, deployment: str, session: str) -> None:
        ids = self._ids
        now = self._clock()
        ids[response_id] = (deployment, session, now)
        ids.move_to_end(response_id)
        while len(ids) > self.max_ids:
            ids.popitem(last=False)
        # Up to two expired ones from the old end: more leave than come, at O(1) a call (a
        # lookup never returns an expired one; the count bound holds meanwhile).
        for _ in range(2):
            oldest, (_, _, at) = next(iter(ids.items()))
            if now - at < self.ttl:
                break
            del ids[oldest]

    def get(self, response_id: str) -> tuple[str, str] | None:
        """(deployment, session) that produced ``response_id``; None when unknown or expired."""
        found = self._ids.get(response_id)
        if found is None:
            return None
        deployment, session, at = found
        if self._clock() - at >= self.ttl:
            del self._ids[response_id]
            return None
        return deployment, session

    def __len__(self) -> int:
        return len(self._ids)


class StoreUnavailable(Exception):
    """The shared store cannot answer now (its breaker is open or the call failed), or, at start
    with ``state.required``, could not be used."""


class SessionState:
    """Where sessions live beyond this process. This base class is the memory backend: every
    session lives in the router's tree and table only, every local end is the end."""

    # Whether sessions are shared with other replicas (the router then reports to this object).
    shared = False
    # Whether response ids are shared too: a response id this replica does not know makes the
    # router's admission need LOAD, and :meth:`load` looks it up in the store.
    shares_responses = False

    def __init__(self, config: Config, ends: SessionEnds) -> None:
        # Runs the sessions that ended (here, or claimed here from a shared store).
        self.ends = ends
        # The response ids this replica knows (Responses API chaining).
        self.responses = ResponseIds.from_config(config)

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

    def used(self, turn: Turn, prompt_tokens: int, cached_tokens: int, reported: bool) -> None:
        """The response of ``turn`` reported its prompt-cache usage (``reported``: these counts,
        already added to the turn's node), or said nothing usable of it (a turn without usage).
        A shared backend writes the increments behind, with the session's next write."""

    def ended(self, ended: Sequence[SessionEnd]) -> None:
        """Sessions that ended in this replica's tree: here they end now (:attr:`ends`); a
        shared backend claims them first, exactly once across the fleet, and runs the ones
        claimed here later."""
        for e in ended:
            self.ends.run(e)

    def remember_response(self, response_id: str, deployment: str, session: str) -> None:
        """A response of ``session`` on ``deployment`` is named ``response_id`` (its body's
        first bytes said so): a request naming it as ``previous_response_id`` continues the
        session."""
        self.responses.remember(response_id, deployment, session)

    def response_session(self, response_id: str) -> tuple[str, str] | None:
        """(deployment, session) that produced ``response_id``, as far as this replica knows."""
        return self.responses.get(response_id)

    def stats(self) -> dict[str, Any]:
        """Counters for metrics (empty for the memory backend)."""
        return {}


class MemoryState(SessionState):
    """Sessions in this process only (``state.url: memory://``)."""
