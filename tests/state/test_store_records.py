"""What the shared store holds is input like any other: records that do not decode, a store that
runs out of memory or would evict, and the facts every replica must report alike (why a session
ended, when)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from sidecar.context import SessionFlag
from tests.state.faults import FaultProxy
from tests.state.fleet import api, finishes, metric, post
from tests.waiting import eventually, wait_for


@pytest.fixture
async def faults(redis_server) -> AsyncIterator[FaultProxy]:
    proxy = await FaultProxy.start(redis_server.port)
    yield proxy
    await proxy.close()


async def test_a_record_that_does_not_decode_is_an_error_for_its_session_only(
    upstream, replicas, http, redis_server, caplog
):
    # Records written by someone else (or a newer version): a count that is not a number, worker
    # history that is not JSON. Requests of those sessions and of their children are served on
    # local state at once (never held by the load), the rest of the fleet goes on, and each bad
    # key is logged once by the replica that read it. (A store slower than timeout_ms under load
    # would take a replica off it, and A would then read its sessions back: not what is tested.)
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router", state={"timeout_ms": 5000})
    p = replicas.prefix
    for sid in ("bad-count", "bad-workers", "fine"):
        assert (await post(http, a, sid))[0] == 200
    await wait_for(lambda: redis_server.cli("EXISTS", p + "s:bad-workers").strip() == "1")
    redis_server.cli("HSET", p + "s:bad-count", "c", "1x")
    redis_server.cli("HSET", p + "s:bad-workers", "w", "{not json")
    caplog.set_level(logging.WARNING, logger="sidecar.state")

    async def served(sid: str, parent: str | None = None) -> int:
        return (await asyncio.wait_for(post(http, b, sid, parent=parent), 5))[0]

    # B loads each of them: 200 at once (the store's answer for that key is treated as unusable)
    assert await served("bad-count") == 200
    assert await served("bad-workers") == 200
    assert await served("child-of-bad", parent="bad-count") == 200
    assert await served("bad-count") == 200
    assert await served("fine") == 200
    assert metric(b, "sidecar_state_store_up") == 1
    assert upstream.received[-1].header("x-session-id") == "fine"
    logged = [r for r in caplog.records if "cannot be read" in r.getMessage()]
    by_b = [r.key for r in logged if r.replica == b.state.replica]
    assert sorted(by_b) == [p + "s:bad-count", p + "s:bad-workers"]  # once each
    assert len({(r.replica, r.key) for r in logged}) == len(logged)  # no replica logs a key twice
    # the sessions API answers for the bad record alone: 503 naming the problem, not a hang
    status, body = await api(http, "GET", b.admin_url + "/v1/sessions/bad-count")
    assert status == 503 and body["error"]["type"] == "store_unavailable"
    status, body = await api(http, "GET", b.admin_url + "/v1/sessions/fine")
    assert status == 200 and body["turns"] == 2


async def test_flags_that_are_not_a_number_never_stop_the_replicas_writes(upstream, replicas, http, redis_server):
    # A record whose flags are garbage is left alone by every script (no script error that would
    # take the replica off the store); the other sessions are written and end as usual. (A store
    # slower than timeout_ms under load would also take it off, and count a flush error: not what
    # is tested.)
    (a,) = await replicas(
        1, upstream=upstream.url, mode="vllm_router", sessions={"idle_ttl_seconds": 1}, state={"timeout_ms": 5000}
    )
    p = replicas.prefix
    assert (await post(http, a, "garbage-flags"))[0] == 200
    await wait_for(lambda: redis_server.cli("EXISTS", p + "s:garbage-flags").strip() == "1")
    redis_server.cli("HSET", p + "s:garbage-flags", "f", "x")
    assert (await post(http, a, "garbage-flags"))[0] == 200
    assert (await post(http, a, "written-anyway"))[0] == 200
    await wait_for(lambda: finishes(upstream, "written-anyway"), timeout=15)  # idle expiry, swept
    assert metric(a, "sidecar_state_store_up") == 1
    assert metric(a, "sidecar_state_ops_total", {"op": "flush", "outcome": "error"}) == 0
    assert redis_server.cli("HGET", p + "s:garbage-flags", "f").strip() == "x"  # untouched


async def test_an_expired_api_session_is_reported_expired_on_every_replica(upstream, replicas, http):
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router")
    sid = "expires-soon"
    # (long enough for both replicas to send their request before it expires, on a busy machine)
    body = {"deployment": "default", "session_id": sid, "ttl_seconds": 5}
    assert (await api(http, "POST", a.admin_url + "/v1/sessions", body))[0] == 201
    assert (await post(http, a, sid))[0] == 200
    assert (await post(http, b, sid))[0] == 200
    await wait_for(lambda: finishes(upstream, sid), timeout=30)
    for sc in (a, b):
        status, answer = await eventually(lambda sc=sc: post(http, sc, sid), lambda r: r[0] != 200, timeout=10)
        assert status == 410 and answer["error"]["type"] == "session_expired", (sc.state.replica, answer)
        status, seen = await api(http, "GET", sc.admin_url + f"/v1/sessions/{sid}")
        assert status == 200 and seen["status"] == "expired"


async def test_a_closed_session_has_one_end_time(upstream, replicas, http):
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router")
    sid = "one-end-time"
    assert (await api(http, "POST", a.admin_url + "/v1/sessions", {"deployment": "default", "session_id": sid}))[
        0
    ] == 201
    assert (await post(http, b, sid))[0] == 200
    status, closed = await api(http, "POST", a.admin_url + f"/v1/sessions/{sid}/close")
    assert status == 200 and closed["ended_at"] is not None
    await wait_for(lambda: finishes(upstream, sid), timeout=10)  # ended in the store since
    for sc in (a, b):
        status, seen = await api(http, "GET", sc.admin_url + f"/v1/sessions/{sid}")
        assert status == 200 and seen["ended_at"] == closed["ended_at"]


async def test_a_store_that_may_evict_session_state_is_named_at_start(upstream, replicas, redis_server, caplog):
    redis_server.cli("CONFIG", "SET", "maxmemory-policy", "volatile-ttl")
    caplog.set_level(logging.WARNING, logger="sidecar.state")
    await replicas(1, upstream=upstream.url, mode="vllm_router")
    (warning,) = [r for r in caplog.records if "maxmemory-policy" in r.getMessage()]
    assert "volatile-ttl" in warning.getMessage() and "noeviction" in warning.getMessage()


async def test_a_full_store_is_an_outage_the_proxy_rides_out(upstream, replicas, http, redis_server):
    # noeviction and maxmemory reached: the store refuses writes. The replica serves on local
    # state (no request fails), and once memory is available again its sessions reach the store.
    (a,) = await replicas(1, upstream=upstream.url, mode="vllm_router")
    p = replicas.prefix
    assert (await post(http, a, "before-full"))[0] == 200
    await wait_for(lambda: redis_server.cli("EXISTS", p + "s:before-full").strip() == "1")
    redis_server.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
    redis_server.cli("CONFIG", "SET", "maxmemory", "1")  # (below what it uses: every write is refused)
    statuses = [(await post(http, a, f"while-full-{i}"))[0] for i in range(20)]
    assert statuses == [200] * 20
    await wait_for(lambda: metric(a, "sidecar_state_store_up") == 0, timeout=10)
    assert redis_server.cli("EXISTS", p + "s:while-full-0").strip() == "0"
    redis_server.cli("CONFIG", "SET", "maxmemory", "0")
    await wait_for(lambda: metric(a, "sidecar_state_store_up") == 1, timeout=60)
    await wait_for(lambda: redis_server.cli("EXISTS", p + "s:while-full-19").strip() == "1", timeout=10)


async def test_a_session_id_that_is_not_utf8_is_shared_and_finished_under_its_own_bytes(upstream, replicas):
    # The bytes travel through the store unchanged (its keys and events): the session is one for
    # the fleet, and its end names exactly the bytes the gateway saw.
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router")

    async def send(sc, final: bool) -> bytes:
        host, port = sc.proxy_url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Correlation-ID: \xff\xfe\x80raw\r\n"
            + (b"X-Session-Final: true\r\n" if final else b"")
            + b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"
        )
        await writer.drain()
        answer = await reader.read()
        writer.close()
        return answer

    assert (await send(a, final=False)).startswith(b"HTTP/1.1 200")
    assert (await send(b, final=True)).startswith(b"HTTP/1.1 200")
    await wait_for(lambda: [r for r in upstream.received if r.path.startswith("/finish_session")], timeout=10)
    await asyncio.sleep(1.0)  # (a second end would have run by now)
    ended = [r.path for r in upstream.received if r.path.startswith("/finish_session")]
    assert ended == ["/finish_session?session_id=%FF%FE%80raw"]


async def test_an_ended_api_sessions_id_is_not_taken_over_by_a_replica_that_missed_the_end(
    faults, upstream, replicas, http, redis_server, monkeypatch
):
    # B holds an API session and hears nothing (its subscription is deaf and never found so, and
    # it sends no request while the close settles): A closes the session, the store ends it. B
    # admits one more request of it, and that request's write is told the session ended. The
    # store keeps the API session's tombstone (its id is not taken over by a new traffic
    # session) and B answers 410 from then on.
    monkeypatch.setattr("sidecar.state.redis.EVENTS_DEAF_SECONDS", 3600.0)
    a = await replicas.one(upstream=upstream.url, mode="vllm_router")
    b = await replicas.one(upstream=upstream.url, mode="vllm_router", state={"url": faults.url})
    sid = "closed-unheard"
    assert (await api(http, "POST", a.admin_url + "/v1/sessions", {"deployment": "default", "session_id": sid}))[
        0
    ] == 201
    assert (await post(http, b, sid))[0] == 200
    faults.silence_subscriptions()
    assert (await api(http, "POST", a.admin_url + f"/v1/sessions/{sid}/close"))[0] == 200
    await wait_for(lambda: finishes(upstream, sid), timeout=15)
    statuses = [(await post(http, b, sid))[0]]
    while statuses[-1] == 200:
        assert len(statuses) < 100, statuses
        await asyncio.sleep(0.05)
        statuses.append((await post(http, b, sid))[0])
    assert statuses[-1] == 410
    flags = int(redis_server.cli("HGET", replicas.prefix + "s:" + sid, "f"))
    assert flags & SessionFlag.API and flags & SessionFlag.ENDED
    assert len(finishes(upstream, sid)) == 1
