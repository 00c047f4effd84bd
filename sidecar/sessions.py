"""Sessions created through the sessions API: lifecycle, expiry, bounded tombstones. No I/O.

A session is created bound to one deployment and owned by one workspace. Its lifecycle is
``active`` -> ``closed`` (through the API) or ``expired`` (no request for ``ttl`` seconds; a
session with requests in flight never expires). Ended sessions stay as tombstones so requests
on them can be answered 410, bounded by count (oldest dropped first) and age (pruned by
:meth:`SessionStore.expire`).

Memory is bounded: at most ``max_sessions`` active sessions (creating more raises
:class:`SessionLimitReached`), at most ``tombstone_max`` tombstones, and an expiry heap holding
one entry per active session with a TTL (compacted when stale entries pile up).

Every method is synchronous and runs on the event loop, so a close and the admission of a
request (:meth:`SessionStore.admit`, called from ``Router.admit``) are ordered: once
:meth:`SessionStore.close` returned, no request of that session is admitted. Time comes from
the injected ``clock`` (wall-clock seconds: timestamps are shown as RFC 3339 UTC).
"""

from __future__ import annotations

import heapq
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sidecar.config import ApiSessionsConfig

Clock = Callable[[], float]


class SessionStatus(StrEnum):
    ACTIVE = "active"
    CLOSED = "closed"
    EXPIRED = "expired"


class SessionExists(Exception):
    """The requested id is taken (by an active session or a tombstone)."""


class SessionLimitReached(Exception):
    """``max_sessions`` active sessions exist already."""


@dataclass(slots=True, eq=False)
class ApiSession:
    """One API-created session. ``seq`` orders sessions by creation (stable pagination)."""

    id: str
    deployment: str
    workspace: str | None
    parent: str | None
    ttl: float | None
    created_at: float
    seq: int
    status: SessionStatus = SessionStatus.ACTIVE
    last_active_at: float | None = None
    ended_at: float | None = None
    in_flight: int = 0
    # The root of its lineage tree when it was created (its parent's); None: its own id (created
    # without a parent). The lineage tree's root wins once the tree holds it (see the views).
    root: str | None = None

    @property
    def expires_at(self) -> float | None:
        """When it expires if it stays idle (None without TTL; the expiry time once expired)."""
        if self.status is SessionStatus.EXPIRED:
            return self.ended_at
        if self.status is not SessionStatus.ACTIVE or self.ttl is None:
            return None
        return (self.last_active_at or self.created_at) + self.ttl

    def as_dict(self) -> dict[str, Any]:
        """The JSON resource (without lineage fields)."""
        return {
            "id": self.id,
            "deployment": self.deployment,
            "workspace": self.workspace,
            "status": self.status.value,
            "parent": self.parent,
            "ttl_seconds": self.ttl,
            "created_at": rfc3339(self.created_at),
            "last_active_at": rfc3339(self.last_active_at),
            "expires_at": rfc3339(self.expires_at),
            "ended_at": rfc3339(self.ended_at),
        }


def rfc3339(ts: float | None) -> str | None:
    """Wall-clock seconds -> ``2026-01-02T03:04:05.678Z`` (None stays None)."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class SessionStore:
    """Active API sessions, their expiry and their tombstones. See the module docstring."""

    def __init__(self, cfg: ApiSessionsConfig, *, clock: Clock = time.time) -> None:
        self.cfg = cfg
        self._clock = clock
        self._seq = 0
        # id -> record, active and tombstoned, in creation order
        # id -> active or tombstoned record; read directly by the router's hot path (no call).
        self.records: dict[str, ApiSession] = {}
        self._active = 0
        # tombstoned id -> None, oldest ended first
        self._tombs: OrderedDict[str, None] = OrderedDict()
        # (deadline, seq, id): at most one live entry per active session with a TTL
        self._heap: list[tuple[float, int, str]] = []

    # -- stats -------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return self._active

    @property
    def tombstones(self) -> int:
        return len(self._tombs)

    # -- API operations ----------------------------------------------------------------------

    def create(
        self,
        *,
        deployment: str,
        workspace: str | None,
        session_id: str | None = None,
        ttl: float | None = None,
        parent: str | None = None,
        root: str | None = None,
    ) -> ApiSession:
        """A new active session; ``ttl=None`` takes the configured default. ``root``: the root of
        the parent's tree (None without a parent: the session is its own root)."""
        if session_id is None:
            session_id = str(uuid.uuid4())
        if session_id in self.records:
            raise SessionExists(session_id)
        if self._active >= self.cfg.max_sessions:
            raise SessionLimitReached(self.cfg.max_sessions)
        if ttl is None:
            ttl = self.cfg.default_ttl_seconds
        now = self._clock()
        self._seq += 1
        rec = ApiSession(session_id, deployment, workspace, parent, ttl, now, self._seq, root=root)
        self.records[session_id] = rec
        self._active += 1
        if ttl is not None:
            heapq.heappush(self._heap, (now + ttl, rec.seq, session_id))
        return rec

    def get(self, session_id: str) -> ApiSession | None:
        """The active or tombstoned record of ``session_id``."""
        return self.records.get(session_id)

    def close(self, session_id: str) -> tuple[ApiSession, bool] | None:
        """Close an active session; returns the record and whether this call closed it.

        Closing a closed or expired session changes nothing. None if the id is unknown.
        """
        rec = self.records.get(session_id)
        if rec is None:
            return None
        if rec.status is not SessionStatus.ACTIVE:
            return rec, False
        self._end(rec, SessionStatus.CLOSED, self._clock())
        return rec, True

    def cache(self, rec: ApiSession) -> None:
        """Hold a record a shared store knows (sidecar.state), replacing the one held. Bounded:
        beyond ``max_sessions`` active plus ``tombstone_max`` records, nothing more is cached
        (the store is asked again)."""
        old = self.records.get(rec.id)
        if old is None and len(self.records) >= self.cfg.max_sessions + self.cfg.tombstone_max:
            return
        if old is not None:
            rec.in_flight = old.in_flight
            if old.status is SessionStatus.ACTIVE:
                self._active -= 1
            else:
                self._tombs.pop(rec.id, None)
        self.records[rec.id] = rec
        if rec.status is SessionStatus.ACTIVE:
            self._active += 1
        else:
            self._tombs[rec.id] = None

    def mark_ended(self, session_id: str, status: SessionStatus, at: float) -> None:
        """The session ended elsewhere (a shared store's event): closed or expired here too."""
        rec = self.records.get(session_id)
        if rec is not None and rec.status is SessionStatus.ACTIVE:
            self._end(rec, status, at)

    def page(
        self,
        *,
        workspace: str | None,
        all_workspaces: bool,
        deployment: str | None = None,
        status: SessionStatus | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> tuple[list[ApiSession], int | None]:
        """One page in creation order, starting after sequence number ``after``.

        Returns the page and the cursor of the next page (None on the last page). O(n) in the
        sessions held, which the bounds cap.
        """
        page: list[ApiSession] = []
        for rec in self._iter_after(after):
            if not all_workspaces and rec.workspace != workspace:
                continue
            if deployment is not None and rec.deployment != deployment:
                continue
            if status is not None and rec.status is not status:
                continue
            if len(page) == limit:
                return page, page[-1].seq
            page.append(rec)
        return page, None

    def _iter_after(self, after: int) -> Iterator[ApiSession]:
        for rec in self.records.values():
            if rec.seq > after:
                yield rec

    # -- request path ------------------------------------------------------------------------

    def begin(self, rec: ApiSession) -> None:
        """A request of the active session ``rec`` was admitted."""
        rec.in_flight += 1
        rec.last_active_at = self._clock()

    def finish(self, rec: ApiSession) -> None:
        """A request of ``rec`` is over (also after the session was closed)."""
        rec.in_flight -= 1
        if rec.status is SessionStatus.ACTIVE:
            rec.last_active_at = self._clock()

    # -- sweep -------------------------------------------------------------------------------

    def expire(self, *, end_active: bool = True) -> list[ApiSession]:
        """End active sessions idle for their TTL, prune old tombstones; returns the expired.
        ``end_active`` False: only prune (a shared store expires sessions fleet-wide)."""
        now = self._clock()
        heap = self._heap
        expired: list[ApiSession] = []
        while end_active and heap and heap[0][0] <= now:
            _, seq, sid = heapq.heappop(heap)
            rec = self.records.get(sid)
            if rec is None or rec.seq != seq or rec.status is not SessionStatus.ACTIVE:
                continue  # stale entry of a closed or replaced session
            assert rec.ttl is not None
            deadline = rec.expires_at
            assert deadline is not None
            if rec.in_flight:
                heapq.heappush(heap, (now + rec.ttl, seq, sid))
            elif deadline > now:
                heapq.heappush(heap, (deadline, seq, sid))
            else:
                self._end(rec, SessionStatus.EXPIRED, deadline)
                expired.append(rec)
        if len(heap) > 2 * self._active + 64:
            self._heap = [
                e
                for e in heap
                if (r := self.records.get(e[2])) is not None and r.seq == e[1] and r.status is SessionStatus.ACTIVE
            ]
            heapq.heapify(self._heap)
        cutoff = now - self.cfg.tombstone_ttl_seconds
        tombs = self._tombs
        while tombs:
            oldest = next(iter(tombs))
            ended_at = self.records[oldest].ended_at
            assert ended_at is not None
            if ended_at > cutoff:
                break
            del tombs[oldest]
            del self.records[oldest]
        return expired

    def _end(self, rec: ApiSession, status: SessionStatus, at: float) -> None:
        rec.status = status
        rec.ended_at = at
        self._active -= 1
        tombs = self._tombs
        tombs[rec.id] = None
        if len(tombs) > self.cfg.tombstone_max:
            oldest, _ = tombs.popitem(last=False)
            del self.records[oldest]
