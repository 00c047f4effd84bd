"""The API session store on hand-built inputs with an injected clock."""

from __future__ import annotations

import pytest

from sidecar.config import ApiSessionsConfig
from sidecar.sessions import SessionExists, SessionLimitReached, SessionStatus, SessionStore, rfc3339
from tests.sessions.support import FakeClock


def store(clock: FakeClock, **cfg) -> SessionStore:
    return SessionStore(ApiSessionsConfig(**cfg), clock=clock)


def test_sliding_ttl_and_in_flight_never_expires():
    clock = FakeClock(1000.0)
    s = store(clock)
    rec = s.create(deployment="d", workspace="w", session_id="a", ttl=10)
    assert rec.expires_at == 1010.0 and rec.last_active_at is None
    clock.advance(8)
    s.begin(rec)  # a long request: in flight across its TTL
    clock.advance(30)
    assert s.expire() == [] and rec.status is SessionStatus.ACTIVE
    s.finish(rec)
    assert rec.expires_at == 1048.0
    clock.advance(9)
    assert s.expire() == []
    clock.advance(1)
    assert s.expire() == [rec] and rec.status is SessionStatus.EXPIRED and rec.ended_at == 1048.0


def test_close_is_idempotent_and_tombstones_are_bounded():
    clock = FakeClock()
    s = store(clock, tombstone_max=3, tombstone_ttl_seconds=60, default_ttl_seconds=None)
    recs = [s.create(deployment="d", workspace=None, session_id=f"s{i}") for i in range(5)]
    assert recs[0].expires_at is None
    for r in recs:
        assert s.close(r.id) == (r, True)
        clock.advance(1)
    assert s.close("s4") == (recs[4], False)
    assert s.close("unknown") is None
    assert s.tombstones == 3 and s.get("s0") is None and s.get("s1") is None and s.get("s2") is not None
    clock.advance(57)  # now 62 s after the first close; s2 closed 60 s ago, s3 59 s ago
    s.expire()
    assert s.tombstones == 2 and s.get("s2") is None and s.get("s3") is not None
    s.create(deployment="d", workspace=None, session_id="s0")  # a forgotten id is free again
    with pytest.raises(SessionExists):
        s.create(deployment="d", workspace=None, session_id="s4")


def test_active_cap_and_heap_stays_bounded():
    clock = FakeClock()
    s = store(clock, max_sessions=10)
    for i in range(10):
        s.create(deployment="d", workspace=None, session_id=f"a{i}", ttl=100)
    with pytest.raises(SessionLimitReached):
        s.create(deployment="d", workspace=None)
    for _ in range(500):  # churn: create and close; stale heap entries are compacted
        s.close(s.page(workspace=None, all_workspaces=True, status=SessionStatus.ACTIVE, limit=1)[0][0].id)
        s.create(deployment="d", workspace=None, ttl=100)
        s.expire()
    assert s.active == 10 and len(s._heap) <= 2 * 10 + 64


def test_list_pages_in_creation_order_per_workspace():
    s = store(FakeClock())
    for i in range(6):
        s.create(deployment="d1" if i < 3 else "d2", workspace="w1" if i % 2 else "w2", session_id=f"x{i}")
    page, nxt = s.page(workspace="w1", all_workspaces=False, limit=2)
    assert [r.id for r in page] == ["x1", "x3"] and nxt is not None
    page, nxt = s.page(workspace="w1", all_workspaces=False, limit=2, after=nxt)
    assert [r.id for r in page] == ["x5"] and nxt is None
    page, _ = s.page(workspace=None, all_workspaces=True, deployment="d2")
    assert [r.id for r in page] == ["x3", "x4", "x5"]


def test_rfc3339():
    assert rfc3339(0.0) == "1970-01-01T00:00:00.000Z"
    assert rfc3339(None) is None
