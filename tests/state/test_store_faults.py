"""The shared store's ordinary hiccups, injected between the replicas and a real redis-server: every
session still ends exactly once, after its last request, on some replica.

Faults come from :mod:`tests.state.faults` (a reply held back past ``timeout_ms``, a deaf
subscription) and from redis-server itself (SIGSTOP, a restart without its data, ``maxmemory``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tests.state.faults import FaultProxy
from tests.state.fleet import api, finishes, metric, post
from tests.waiting import wait_for

LATE = 1.0  # seconds a held reply is late: four times the default timeout_ms


@pytest.fixture
async def faults(redis_server) -> AsyncIterator[FaultProxy]:
    proxy = await FaultProxy.start(redis_server.port)
    yield proxy
    await proxy.close()


async def _ends_once(upstream, sessions: list[str], *, timeout: float = 20.0) -> None:
    """Every one of ``sessions`` got exactly one ``finish_session``, and no more come."""
    await wait_for(lambda: all(finishes(upstream, s) for s in sessions), timeout=timeout)
    await asyncio.sleep(1.5)  # (a second claimer would have run by now: two sweeps, a settle window)
    assert {s: len(finishes(upstream, s)) for s in sessions} == dict.fromkeys(sessions, 1)


async def test_an_api_close_whose_claim_reply_is_late_still_ends_the_session_once(faults, upstream, replicas, http):
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router", state={"url": faults.url})
    sid = "late-claim-close"
    assert (await api(http, "POST", a.admin_url + "/v1/sessions", {"deployment": "default", "session_id": sid}))[
        0
    ] == 201
    assert (await post(http, b, sid))[0] == 200
    held = faults.delay_reply_with(sid, LATE)  # the claim's reply names the session it ended
    status, closed = await api(http, "POST", a.admin_url + f"/v1/sessions/{sid}/close")
    assert status == 200 and closed["status"] == "closed"
    await wait_for(held.is_set, timeout=10)
    await _ends_once(upstream, [sid])


async def test_a_final_turn_whose_claim_reply_is_late_still_ends_the_session_once(faults, upstream, replicas, http):
    (a,) = await replicas(1, upstream=upstream.url, mode="vllm_router", state={"url": faults.url})
    sessions = [f"late-final-{i}" for i in range(5)]
    for sid in sessions:
        assert (await post(http, a, sid))[0] == 200
    for sid in sessions:
        held = faults.delay_reply_with(sid, LATE)
        assert (await post(http, a, sid, final=True))[0] == 200
        await wait_for(held.is_set, timeout=10)
    await _ends_once(upstream, sessions)
    ended = metric(a, "sidecar_sessions_ended_total", {"deployment": "default", "reason": "final_turn_completed"})
    assert ended == len(sessions)


async def test_an_idle_sweep_whose_reply_is_late_still_ends_every_session_it_claimed_once(
    faults, upstream, replicas, http
):
    a, b = await replicas(
        2, upstream=upstream.url, mode="vllm_router", state={"url": faults.url}, sessions={"idle_ttl_seconds": 1}
    )
    sessions = [f"idle-batch-{i:02d}" for i in range(50)]
    held = faults.delay_reply_with("idle-batch-", LATE)  # the sweep's reply: every session it claimed
    await asyncio.gather(*(post(http, a if i % 2 else b, sid) for i, sid in enumerate(sessions)))
    await wait_for(held.is_set, timeout=15)
    await _ends_once(upstream, sessions, timeout=30)
    total = sum(
        metric(sc, "sidecar_sessions_ended_total", {"deployment": "default", "reason": "idle_expired"}) for sc in (a, b)
    )
    assert total == len(sessions)
