"""Two and three sidecars sharing one Redis: one fleet. API sessions, one lineage tree, ends
exactly once, durability across restarts, the store's faults, the cost on the request path."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import aiohttp
import pytest

from tests.state.fleet import api, finishes, metric, post
from tests.waiting import eventually, wait_for


async def test_an_api_session_created_on_one_replica_is_usable_and_closable_on_another(upstream, replicas, http):
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router")
    status, created = await api(
        http, "POST", a.admin_url + "/v1/sessions", {"deployment": "default", "session_id": "api-1"}
    )
    assert status == 201
    status, seen = await api(http, "GET", b.admin_url + "/v1/sessions/api-1")
    assert status == 200 and seen["id"] == "api-1" and seen["status"] == "active" and seen["origin"] == "api"
    assert (await post(http, b, "api-1"))[0] == 200
    assert upstream.received[-1].header("x-session-id") == "api-1"
    status, closed = await api(http, "POST", b.admin_url + "/v1/sessions/api-1/close")
    assert status == 200 and closed["status"] == "closed"
    # (within the store's event latency: milliseconds; the deadline only bounds a failing test)
    status, body = await eventually(lambda: post(http, a, "api-1"), lambda got: got[0] == 410, timeout=10)
    assert body["error"]["type"] == "session_closed"
    # the end-of-session action ran once, for the fleet
    await wait_for(lambda: len(finishes(upstream, "api-1")) >= 1)
    await asyncio.sleep(0.5)
    assert len(finishes(upstream, "api-1")) == 1


def sweeps(sc: Any) -> float:
    """Lazy writes done (each is followed by the store's sweep)."""
    return metric(sc, "sidecar_state_ops_total", {"op": "sweep", "outcome": "ok"})


async def test_a_close_lets_requests_in_flight_elsewhere_finish_and_ends_once_after_the_last(upstream, replicas, http):
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router")
    status, _ = await api(http, "POST", a.admin_url + "/v1/sessions", {"deployment": "default", "session_id": "s1"})
    assert status == 201

    async def stream() -> bytes:
        async with http.get(b.proxy_url + "/sse?chunks=8&gap=0.1", headers={"X-Correlation-ID": "s1"}) as resp:
            assert resp.status == 200
            return await resp.read()

    task = asyncio.create_task(stream())
    await wait_for(lambda: len(upstream.sse_sent_at) >= 2)
    status, closed = await api(http, "POST", a.admin_url + "/v1/sessions/s1/close")
    assert status == 200 and closed["status"] == "closed"
    body = await task
    assert body.count(b"data: ") == 9  # 8 events and [DONE]: the stream in flight finished whole
    assert (await post(http, b, "s1"))[0] == 410
    await wait_for(lambda: len(finishes(upstream, "s1")) >= 1)
    await asyncio.sleep(0.6)
    (finish,) = finishes(upstream, "s1")
    assert finish.at >= upstream.sse_sent_at[-1]  # after the last byte of the last request in flight
    assert (
        sum(
            metric(sc, "sidecar_sessions_ended_total", {"deployment": "default", "reason": "api_closed"})
            for sc in (a, b)
        )
        == 1
    )


async def test_a_child_on_another_replica_joins_the_parents_tree(replicas, http, start_upstreams):
    ups = await start_upstreams(3)
    deployment = {
        "name": "chat",
        "upstreams": [u.url for u in ups],
        "mode": "smg_routing_key",
        "mode_options": {"scope": "tree"},
    }
    a, b = await replicas(2, upstream=None, deployments=[deployment])
    for _ in range(2):
        assert (await post(http, a, "P"))[0] == 200
    assert (await post(http, b, "C", parent="P"))[0] == 200
    assert (await post(http, b, "P"))[0] == 200
    got = [(r.header("X-SMG-Routing-Key"), i) for i, u in enumerate(ups) for r in u.received]
    assert {key for key, _ in got} == {"P"}  # the child's routing key is its tree's root, on either replica
    assert len({i for _, i in got}) == 1  # and its tree's upstream
    for sc in (a, b):
        # Each replica writes its turns behind (within flush_interval_ms): wait for them, not longer.
        await eventually(
            lambda sc=sc: api(http, "GET", sc.admin_url + "/v1/trees/C"),
            lambda got: got[0] == 200 and got[1]["turns"] == 3 and got[1]["children"],
        )
        status, tree = await api(http, "GET", sc.admin_url + "/v1/trees/C")
        assert status == 200, tree
        assert (tree["session"], tree["turns"]) == ("P", 3)  # turns counted on both replicas
        assert [(c["session"], c["parent"], c["root"], c["turns"]) for c in tree["children"]] == [("C", "P", "P", 1)]
        status, node = await api(http, "GET", sc.admin_url + "/v1/sessions/C")
        assert status == 200 and node["root"] == "P" and node["parent"] == "P"
        status, data = await api(http, "GET", sc.admin_url + "/ui/data.json")
        assert status == 200 and [t["root"] for t in data["trees"]] == ["P"]
        assert [c["session"] for c in data["trees"][0]["tree"]["children"]] == ["C"]


async def test_a_final_turn_on_one_replica_ends_the_session_once_for_the_fleet(upstream, replicas, http):
    a, b, c = await replicas(3, upstream=upstream.url, mode="vllm_router")
    assert (await post(http, a, "f1"))[0] == 200
    assert (await post(http, b, "f1"))[0] == 200
    assert (await post(http, c, "f1", final=True))[0] == 200
    await wait_for(lambda: len(finishes(upstream, "f1")) >= 1)
    await asyncio.sleep(0.6)
    assert len(finishes(upstream, "f1")) == 1
    assert (
        sum(
            metric(sc, "sidecar_sessions_ended_total", {"deployment": "default", "reason": "final_turn_completed"})
            for sc in (a, b, c)
        )
        == 1
    )
    # a new request on the id starts a new session on any replica (turn 1 again)
    assert (await post(http, a, "f1"))[0] == 200
    await eventually(
        lambda: api(http, "GET", b.admin_url + "/v1/sessions/f1"),
        lambda got: got[0] == 200 and got[1]["status"] == "active" and got[1]["turns"] == 1,
    )


async def test_worker_history_is_one_history_across_replicas(upstream, replicas, http):
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router")
    for _ in range(2):
        assert (await post(http, a, "wh", path="/worker?w=wa"))[0] == 200
    # written behind within a second, then read on the other replica
    await eventually(
        lambda: api(http, "GET", b.admin_url + "/v1/sessions/wh"),
        lambda got: got[0] == 200 and got[1]["workers"] == [{"worker": "wa", "turns": 2}],
        timeout=3,
    )
    assert (await post(http, b, "wh", path="/worker?w=wb"))[0] == 200
    status, got = await eventually(
        lambda: api(http, "GET", a.admin_url + "/v1/sessions/wh"),
        lambda got: got[0] == 200 and got[1]["workers"] == [{"worker": "wa", "turns": 2}, {"worker": "wb", "turns": 1}],
        timeout=3,
    )
    assert got["turns"] == 3 and got["affinity"]["moved"] == 1


async def test_idle_expiry_is_claimed_by_one_replica(upstream, replicas, http):
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router", sessions={"idle_ttl_seconds": 1})
    assert (await post(http, a, "idle-1"))[0] == 200
    assert (await post(http, b, "idle-1"))[0] == 200
    await wait_for(lambda: len(finishes(upstream, "idle-1")) >= 1, timeout=8)
    await asyncio.sleep(1.5)
    assert len(finishes(upstream, "idle-1")) == 1
    assert (
        sum(
            metric(sc, "sidecar_sessions_ended_total", {"deployment": "default", "reason": "idle_expired"})
            for sc in (a, b)
        )
        == 1
    )


async def test_the_live_session_cap_evicts_fleet_wide_once(upstream, replicas, http):
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router", sessions={"max_live_sessions": 2})
    assert (await post(http, a, "e1"))[0] == 200
    assert (await post(http, b, "e2"))[0] == 200
    assert (await post(http, a, "e3"))[0] == 200
    await wait_for(
        lambda: (
            sum(
                metric(sc, "sidecar_sessions_ended_total", {"deployment": "default", "reason": "evicted"})
                for sc in (a, b)
            )
            >= 1
        ),
        timeout=8,
    )
    await asyncio.sleep(1.5)
    assert (
        sum(metric(sc, "sidecar_sessions_ended_total", {"deployment": "default", "reason": "evicted"}) for sc in (a, b))
        == 1
    )
    assert len([r for r in upstream.received if r.path.startswith("/finish_session")]) == 1


async def test_restarting_every_replica_keeps_sessions_bindings_and_tombstones(upstream, replicas, http, redis_server):
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router")
    assert (await api(http, "POST", a.admin_url + "/v1/sessions", {"deployment": "default", "session_id": "keep"}))[
        0
    ] == 201
    assert (await api(http, "POST", a.admin_url + "/v1/sessions", {"deployment": "default", "session_id": "gone"}))[
        0
    ] == 201
    assert (await api(http, "POST", b.admin_url + "/v1/sessions/gone/close"))[0] == 200
    assert (await post(http, a, "root-1"))[0] == 200
    assert (await post(http, b, "kid-1", parent="root-1"))[0] == 200
    await wait_for(lambda: len(finishes(upstream, "gone")) == 1)
    for sc in (a, b):
        await sc.stop()
    finished = len([r for r in upstream.received if r.path.startswith("/finish_session")])
    for restart_redis in (False, True):
        if restart_redis:  # and the store itself, from its append-only file
            redis_server.kill(signal.SIGTERM)
            redis_server.start()
        c, d = await replicas(2, upstream=upstream.url, mode="vllm_router")
        status, kept = await api(http, "GET", d.admin_url + "/v1/sessions/keep")
        assert status == 200 and kept["status"] == "active"
        status, body = await post(http, c, "gone")
        assert status == 410 and body["error"]["type"] == "session_closed"
        assert (await post(http, d, "kid-1"))[0] == 200
        status, node = await api(http, "GET", c.admin_url + "/v1/sessions/kid-1")
        assert status == 200 and node["root"] == "root-1"
        for sc in (c, d):
            await sc.stop()
        # no end action was repeated, and stopping replicas ends nothing
        assert len([r for r in upstream.received if r.path.startswith("/finish_session")]) == finished


async def test_an_unreachable_store_at_start_serves_on_local_state(upstream, replicas, http, redis_server):
    redis_server.kill()
    a = await replicas.one(upstream=upstream.url, mode="dynamo_headers")
    assert (await post(http, a, "local-1"))[0] == 200
    assert upstream.received[-1].header("X-Dynamo-Session-ID") == "local-1"
    assert metric(a, "sidecar_state_store_up") == 0
    redis_server.start()
    await wait_for(lambda: metric(a, "sidecar_state_store_up") == 1, timeout=10)
    # once the store answers, what was served locally is shared
    await wait_for(lambda: "local-1" in redis_server.cli("--scan", "--pattern", replicas.prefix + "s:*"), timeout=5)


async def test_a_required_store_that_is_unreachable_stops_the_start(upstream, replicas, redis_server):
    from sidecar.state.redis import StoreUnavailable

    redis_server.kill()
    with pytest.raises(StoreUnavailable, match="state.required"):
        await replicas.one(upstream=upstream.url, state={"required": True})


async def test_a_store_outage_under_load_fails_no_request(upstream, replicas, http, redis_server):
    a, b = await replicas(2, upstream=upstream.url, mode="dynamo_headers", state={"timeout_ms": 200})
    for i in range(5):
        assert (await post(http, a, f"known-{i}"))[0] == 200
    redis_server.kill()
    statuses = []
    for i in range(40):
        sc = (a, b)[i % 2]
        statuses.append((await post(http, sc, f"known-{i % 5}" if i % 3 else f"new-{i}"))[0])
    assert statuses == [200] * 40
    assert metric(a, "sidecar_state_store_up") == 0 and metric(b, "sidecar_state_store_up") == 0
    redis_server.start()
    await wait_for(
        lambda: metric(a, "sidecar_state_store_up") == 1 and metric(b, "sidecar_state_store_up") == 1, timeout=40
    )
    # sessions first seen during the outage are republished: the other replica finds them
    await wait_for(lambda: "new-3" in redis_server.cli("--scan", "--pattern", replicas.prefix + "s:*"), timeout=5)
    # (a store read that times out on a loaded machine answers 503 store_unavailable, Retry-After
    # 1: a client retries that; any other answer is final)
    status, node = await eventually(
        lambda: api(http, "GET", b.admin_url + "/v1/sessions/new-3"),
        lambda got: not (got[0] == 503 and got[1]["error"]["type"] == "store_unavailable"),
        timeout=10,
        interval=0.2,
    )
    assert status == 200 and node["id"] == "new-3"


async def test_a_known_session_costs_no_round_trip_and_a_new_one_at_most_one(upstream, replicas, http):
    a, _ = await replicas(2, upstream=upstream.url, mode="dynamo_headers")
    assert (await post(http, a, "hot"))[0] == 200
    loads = metric(a, "sidecar_state_ops_total", {"op": "load", "outcome": "ok"})
    assert loads == 1
    for _ in range(30):
        assert (await post(http, a, "hot"))[0] == 200
    assert metric(a, "sidecar_state_ops_total", {"op": "load", "outcome": "ok"}) == loads
    assert (await post(http, a, "kid", parent="unknown-parent"))[0] == 200  # session and parent: one read
    assert metric(a, "sidecar_state_ops_total", {"op": "load", "outcome": "ok"}) == loads + 1


async def test_writes_behind_are_one_round_trip_each(upstream, replicas, http, redis_server):
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router")
    assert (await post(http, a, "rt-warm"))[0] == 200
    await wait_for(lambda: sweeps(a) >= 1, timeout=4)  # a lazy write and a sweep: every script ran once
    redis_server.cli("CONFIG", "RESETSTAT")
    trips = metric(a, "sidecar_state_round_trips_total")
    for i in range(20):
        assert (await post(http, a, f"rt-{i % 4}"))[0] == 200
    swept = sweeps(a)
    await wait_for(lambda: sweeps(a) >= swept + 2, timeout=4)  # a whole lazy write after the requests
    stats = redis_server.cli("INFO", "commandstats")
    assert "cmdstat_evalsha:" in stats
    # scripts run by hash: no SCRIPT EXISTS / LOAD ahead of each pipelined write
    assert "cmdstat_script" not in stats, stats
    assert metric(a, "sidecar_state_round_trips_total") > trips
    # a store that lost its scripts (restart, SCRIPT FLUSH) gets them again; nothing is lost
    redis_server.cli("SCRIPT", "FLUSH")
    assert (await post(http, a, "rt-after-flush"))[0] == 200
    await eventually(
        lambda: api(http, "GET", b.admin_url + "/v1/sessions/rt-after-flush"),
        lambda got: got[0] == 200 and got[1]["turns"] == 1,
    )


async def test_every_key_has_a_ttl(upstream, replicas, http, redis_server):
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router")
    await api(http, "POST", a.admin_url + "/v1/sessions", {"deployment": "default", "session_id": "ttl-api"})
    assert (await post(http, a, "ttl-root"))[0] == 200
    assert (await post(http, b, "ttl-kid", parent="ttl-root"))[0] == 200
    assert (await post(http, b, "ttl-kid", final=True))[0] == 200
    await wait_for(lambda: sweeps(a) >= 2 and sweeps(b) >= 2, timeout=4)  # lazy writes: leases, shared keys
    keys = redis_server.cli("--scan", "--pattern", replicas.prefix + "*").split()
    assert len(keys) >= 6
    for key in keys:
        assert int(redis_server.cli("TTL", key)) > 0, key


@pytest.mark.parametrize("engine", ["fast"])
async def test_a_replica_killed_mid_session_loses_only_its_unflushed_writes(
    upstream, replicas, http, redis_server, tmp_path
):
    import subprocess
    import sys

    import yaml

    from tests.proxy.test_errors import free_ports

    port, admin = free_ports(2)
    config = tmp_path / "a.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "listen": f"127.0.0.1:{port}",
                "admin": f"127.0.0.1:{admin}",
                "upstream": upstream.url,
                "mode": "vllm_router",
                "readiness_check_upstream": False,
                "state": {"url": redis_server.url, "key_prefix": replicas.prefix},
            }
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "run", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        b = await replicas.one(upstream=upstream.url, mode="vllm_router")

        class A:
            proxy_url = f"http://127.0.0.1:{port}"
            admin_url = f"http://127.0.0.1:{admin}"

        async def ready() -> tuple[int, Any]:
            try:
                return await api(http, "GET", A.admin_url + "/healthz")
            except aiohttp.ClientError:
                return 0, None

        await eventually(ready, lambda got: got[0] == 200, timeout=30)
        for _ in range(3):
            async with http.post(
                A.proxy_url + "/v1/chat/completions", headers={"X-Correlation-ID": "k1"}, data=b"{}"
            ) as resp:
                assert resp.status == 200
        # turn counts are written behind within a second (the documented bound)
        await eventually(
            lambda: api(http, "GET", b.admin_url + "/v1/sessions/k1"),
            lambda got: got[0] == 200 and got[1]["turns"] == 3,
            timeout=3,
        )
        assert (await post(http, b, "b1"))[0] == 200
        stream = await http.get(A.proxy_url + "/sse?chunks=50&gap=0.2", headers={"X-Correlation-ID": "k2"})
        assert stream.status == 200
        await eventually(
            lambda: api(http, "GET", b.admin_url + "/v1/sessions/k2"),
            lambda got: got[0] == 200 and got[1]["in_flight"] == 1,
        )
        proc.kill()  # SIGKILL: no drain, no last flush
        proc.wait(10)
        stream.close()
        # what A wrote is kept (its last flush interval at most is lost), B's own session untouched
        status, k1 = await api(http, "GET", b.admin_url + "/v1/sessions/k1")
        assert status == 200 and k1["turns"] == 3
        status, b1 = await api(http, "GET", b.admin_url + "/v1/sessions/b1")
        assert status == 200 and b1["turns"] == 1 and b1["status"] == "active"
        # k2 was in flight on A: closing it waits for A's holder, then A's lease runs out and the
        # session ends exactly once
        status, _ = await api(http, "POST", b.admin_url + "/v1/sessions/k2/close")
        assert status == 200
        await wait_for(lambda: len(finishes(upstream, "k2")) >= 1, timeout=20)
        await asyncio.sleep(1.5)
        assert len(finishes(upstream, "k2")) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


async def test_writes_behind_are_bounded_during_an_outage_and_drops_are_counted(
    upstream, replicas, http, redis_server, monkeypatch
):
    from sidecar.state import redis as store

    monkeypatch.setattr(store, "MAX_DIRTY", 5)
    a = await replicas.one(upstream=upstream.url, mode="dynamo_headers")
    redis_server.kill()
    for i in range(20):
        assert (await post(http, a, f"outage-{i}"))[0] == 200
    assert metric(a, "sidecar_state_dropped_writes_total") >= 15
    assert len(a.state._dirty) <= 5
