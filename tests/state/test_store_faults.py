"""The shared store's ordinary hiccups, injected between the replicas and a real redis-server: every
session still ends exactly once, after its last request, on some replica.

Faults come from :mod:`tests.state.faults` (a reply held back past ``timeout_ms``, a deaf
subscription) and from redis-server itself (SIGSTOP, a restart without its data, ``maxmemory``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

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


async def _ends_once(upstream, sessions: list[str], *, timeout: float = 20.0, store=None, fleet=()) -> None:
    """Every one of ``sessions`` got exactly one ``finish_session``, and no more come. (``store``
    and ``fleet``: what a failure shows of the store's records and the replicas' state.)"""
    try:
        await wait_for(lambda: all(finishes(upstream, s) for s in sessions), timeout=timeout)
    except AssertionError as exc:
        seen = []
        for s in sessions:
            if store is not None:
                seen.append(f"{s}: {store.redis.cli('HGETALL', store.prefix + 's:' + s).split()}")
        if store is not None:
            seen.append(f"ends: {store.redis.cli('ZRANGE', store.prefix + 'ends', '0', '-1', 'WITHSCORES').split()}")
        for r in fleet:
            st = r.state
            seen.append(
                f"replica {st.replica}: up {st.up} ending {dict(st._ending)} checks {dict(st._checks)}"
                f" running {dict(st._running)} acks {dict(st._acks)}"
            )
        raise AssertionError("\n".join([str(exc), *seen])) from None
    await asyncio.sleep(1.5)  # (a second claimer would have run by now: two sweeps, a settle window)
    assert {s: len(finishes(upstream, s)) for s in sessions} == dict.fromkeys(sessions, 1)


async def test_an_api_close_whose_claim_reply_is_late_still_ends_the_session_once(
    faults, upstream, replicas, http, redis_server
):
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
    await _ends_once(upstream, [sid], store=SimpleNamespace(redis=redis_server, prefix=replicas.prefix), fleet=(a, b))


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


async def test_no_request_waits_for_a_hung_store_once_the_breaker_opened(faults, upstream, replicas, http):
    # A store that fails and then hangs: the request path never waits for the breaker's probe,
    # which runs off it (here each probe would hang its whole 10 s timeout).
    (a,) = await replicas(1, upstream=upstream.url, mode="vllm_router", state={"url": faults.url, "timeout_ms": 10000})
    assert (await post(http, a, "before-the-hang"))[0] == 200
    faults.blackhole()
    await wait_for(lambda: metric(a, "sidecar_state_store_up") == 0, timeout=15)
    await asyncio.sleep(2)  # (the breaker's first backoff passed: a probe is due, and hangs)
    probes_failed = metric(a, "sidecar_state_ops_total", {"op": "ping", "outcome": "error"})
    statuses = [(await post(http, a, f"during-the-hang-{i}"))[0] for i in range(10)]
    assert statuses == [200] * 10
    # answered while every probe still hangs: none of them waited for one
    assert metric(a, "sidecar_state_ops_total", {"op": "ping", "outcome": "error"}) == probes_failed


async def test_a_store_that_lost_its_data_gets_back_the_requests_in_flight_and_the_turns(
    upstream, replicas, http, redis_server
):
    # B streams a session when the store restarts without its data. Both replicas republish what
    # they hold: B its request in flight and its turn count. A close on A then ends the session
    # only after B's stream, and the turns are the fleet's.
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router")
    sid = "lost-data"
    assert (await api(http, "POST", a.admin_url + "/v1/sessions", {"deployment": "default", "session_id": sid}))[
        0
    ] == 201
    assert (await post(http, a, sid))[0] == 200
    # A's turn is in the store before B loads the session: B's count then includes it (a replica
    # that loaded before another's write landed republishes only what it saw: docs/state.md)
    await a.state.flush_pending()

    async def stream() -> bytes:
        async with http.get(b.proxy_url + "/sse?chunks=30&gap=0.2", headers={"X-Correlation-ID": sid}) as resp:
            assert resp.status == 200
            return await resp.read()

    streaming = asyncio.create_task(stream())
    key = replicas.prefix + "s:" + sid
    holder = "h:" + b.state.replica
    await wait_for(lambda: redis_server.cli("HGET", key, holder).strip() == "1", timeout=10)
    redis_server.restart_empty()
    await wait_for(lambda: redis_server.cli("HGET", key, holder).strip() == "1", timeout=20)
    await wait_for(lambda: redis_server.cli("HGET", key, "n").strip() == "2", timeout=10)
    status, closed = await api(http, "POST", a.admin_url + f"/v1/sessions/{sid}/close")
    assert status == 200 and closed["status"] == "closed"
    body = await streaming
    assert body.count(b"data: ") == 31  # the stream finished whole
    await wait_for(lambda: finishes(upstream, sid), timeout=20)
    (finish,) = finishes(upstream, sid)
    assert finish.at >= upstream.sse_sent_at[-1]  # after the last byte of B's request


async def test_a_deaf_subscription_is_found_and_the_replica_learns_the_close(
    faults, upstream, replicas, http, redis_server
):
    # B's event subscription stays open and delivers nothing (an expired NAT entry). B finds it
    # deaf, subscribes again and checks what it holds against the store: it stops admitting the
    # session A closed, without a request of it.
    from sidecar.sessions import SessionStatus

    a = await replicas.one(upstream=upstream.url, mode="vllm_router")
    b = await replicas.one(upstream=upstream.url, mode="vllm_router", state={"url": faults.url})
    sid = "deaf-close"
    assert (await api(http, "POST", a.admin_url + "/v1/sessions", {"deployment": "default", "session_id": sid}))[
        0
    ] == 201
    assert (await post(http, b, sid))[0] == 200
    faults.silence_subscriptions()
    assert (await api(http, "POST", a.admin_url + f"/v1/sessions/{sid}/close"))[0] == 200
    await wait_for(lambda: metric(b, "sidecar_state_ops_total", {"op": "events", "outcome": "deaf"}) >= 1, timeout=30)
    await wait_for(lambda: b.router.store.get(sid).status is SessionStatus.CLOSED, timeout=10)
    assert (await post(http, b, sid))[0] == 410
    await _ends_once(upstream, [sid])


async def test_a_holder_written_by_a_write_whose_reply_was_lost_is_corrected(faults, upstream, replicas, http):
    # B has not heard of A's close (its subscription is deaf) and admits a request of the
    # session. B's write of that request in flight reaches the store, whose reply (which names
    # the closing session) comes too late: B counts the write as failed. The request finishes
    # meanwhile, so B's count is back to what it last wrote; the store still held B's request,
    # and the end waited for it forever. B writes its count again after a failed write.
    a = await replicas.one(upstream=upstream.url, mode="vllm_router")
    b = await replicas.one(upstream=upstream.url, mode="vllm_router", state={"url": faults.url})
    sid = "lost-holder-write"
    assert (await api(http, "POST", a.admin_url + "/v1/sessions", {"deployment": "default", "session_id": sid}))[
        0
    ] == 201
    assert (await post(http, b, sid))[0] == 200
    await b.state.flush_pending()  # (nothing of it pending on B: its next write is the next request's)
    faults.silence_subscriptions()
    assert (await api(http, "POST", a.admin_url + f"/v1/sessions/{sid}/close"))[0] == 200
    held = faults.delay_reply_with(sid, LATE)
    # B did not know yet; the stream ends while B's breaker is open after the lost reply
    async with http.get(b.proxy_url + "/sse?chunks=3&gap=0.2", headers={"X-Correlation-ID": sid}) as resp:
        assert resp.status == 200
        assert (await resp.read()).count(b"data: ") == 4
    assert held.is_set()
    await _ends_once(upstream, [sid], timeout=30)


async def test_a_replica_with_a_deaf_subscription_learns_a_close_from_its_writes(
    faults, upstream, replicas, http, monkeypatch
):
    # Events are not the only way: the writes of a session's turns are answered with its state,
    # so B stops admitting the session A closed even while its subscription is not (yet) found
    # deaf (here it never is).
    monkeypatch.setattr("sidecar.state.redis.EVENTS_DEAF_SECONDS", 3600.0)
    a = await replicas.one(upstream=upstream.url, mode="vllm_router")
    b = await replicas.one(upstream=upstream.url, mode="vllm_router", state={"url": faults.url})
    sid = "deaf-close-write"
    assert (await api(http, "POST", a.admin_url + "/v1/sessions", {"deployment": "default", "session_id": sid}))[
        0
    ] == 201
    assert (await post(http, b, sid))[0] == 200
    faults.silence_subscriptions()
    assert (await api(http, "POST", a.admin_url + f"/v1/sessions/{sid}/close"))[0] == 200
    statuses: list[int] = []
    while not statuses or statuses[-1] != 410:
        statuses.append((await post(http, b, sid))[0])
        assert len(statuses) <= 200, statuses
        await asyncio.sleep(0.05)
    assert set(statuses[:-1]) <= {200}
    assert metric(b, "sidecar_state_ops_total", {"op": "events", "outcome": "deaf"}) == 0
    await _ends_once(upstream, [sid])


async def test_no_shared_index_expires_before_what_it_indexes(upstream, replicas, http, redis_server):
    # An API session that outlives idle TTL + tombstone TTL: the listing, the count, the live set
    # and its parent's children set live at least as long as its record.
    a, b = await replicas(
        2, upstream=upstream.url, mode="vllm_router", sessions={"idle_ttl_seconds": 1, "tombstone_ttl_seconds": 0}
    )
    for sid, parent in (("long-parent", None), ("long-child", "long-parent")):
        body = {"deployment": "default", "session_id": sid, "ttl_seconds": 600000}
        if parent:
            body["parent"] = parent
        assert (await api(http, "POST", a.admin_url + "/v1/sessions", body))[0] == 201
    assert (await post(http, b, "a-traffic-session"))[0] == 200
    sweeps = metric(a, "sidecar_state_ops_total", {"op": "sweep", "outcome": "ok"})
    await wait_for(lambda: metric(a, "sidecar_state_ops_total", {"op": "sweep", "outcome": "ok"}) >= sweeps + 2)
    p = replicas.prefix

    def ttl(key: str) -> int:
        return int(redis_server.cli("TTL", p + key))

    record = ttl("s:long-child")
    assert record > 600000
    for index in ("live", "api", "seq", "apin", "k:long-parent"):
        assert ttl(index) >= record, (index, ttl(index), record)


async def test_pending_writes_past_their_bound_drop_the_oldest_and_the_republish_recovers_them(
    faults, upstream, replicas, http, redis_server, monkeypatch
):
    # During an outage the table of pending writes keeps the newest MAX_DIRTY sessions (the
    # oldest are dropped first and counted); when the store is back, every live session held
    # here is republished, the dropped ones included.
    monkeypatch.setattr("sidecar.state.redis.MAX_DIRTY", 50)
    (a,) = await replicas(1, upstream=upstream.url, mode="vllm_router", state={"url": faults.url})
    assert (await post(http, a, "before-outage"))[0] == 200
    faults.blackhole()
    await wait_for(lambda: metric(a, "sidecar_state_store_up") == 0, timeout=15)
    for i in range(80):
        assert (await post(http, a, f"pending-{i:02d}"))[0] == 200
    # (30 new sessions, and the first session's last write if it was still pending)
    assert metric(a, "sidecar_state_dropped_writes_total") in (30, 31)
    faults.restore()
    await wait_for(lambda: metric(a, "sidecar_state_store_up") == 1, timeout=40)
    p = replicas.prefix
    await wait_for(
        lambda: all(redis_server.cli("EXISTS", p + f"s:pending-{i:02d}").strip() == "1" for i in (0, 29, 30, 79)),
        timeout=10,
    )
