"""The fleet at its edges: ids a hostile client picks, a close racing a reused id, the store
losing its data, admin views over huge trees, a misconfigured store."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from typing import Any

from sidecar.sessions import rfc3339
from sidecar.state.redis import MAX_CHILDREN_READ
from tests.state.fleet import api, finishes, metric, post
from tests.waiting import eventually, wait_for


async def test_an_id_with_a_space_closes_only_itself_on_every_replica(upstream, replicas, http):
    # The close event carries the id and the reason in one message: an id holding a space must
    # not be read as another session's id (a traffic or an API session) where it is received.
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router")
    status, _ = await api(http, "POST", a.admin_url + "/v1/sessions", {"deployment": "default", "session_id": "job"})
    assert status == 201
    for sc in (a, b):
        assert (await post(http, sc, "victim"))[0] == 200
        assert (await post(http, sc, "job"))[0] == 200
    assert (await post(http, a, "victim x", final=True))[0] == 200
    assert (await post(http, a, "job api_closed", final=True))[0] == 200
    await wait_for(lambda: len(finishes(upstream, "victim x")) == 1 and len(finishes(upstream, "job api_closed")) == 1)
    await asyncio.sleep(0.8)  # past the settle window: a misread close would have ended them by now
    assert finishes(upstream, "victim") == [] and finishes(upstream, "job") == []
    for sc in (a, b):
        for sid in ("victim", "job"):
            status, seen = await api(http, "GET", sc.admin_url + "/v1/sessions/" + sid)
            assert status == 200 and seen["status"] == "active", (sid, seen)
            assert (await post(http, sc, sid))[0] == 200


async def test_a_closed_session_ends_after_its_last_request_even_when_its_id_is_reused_meanwhile(
    upstream, replicas, http
):
    # B holds a slow request of "t1"; A closes t1; B then takes a new request on the same id. B
    # reports one count per id to the store: the new request must not hide the slow one.
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router")
    assert (await post(http, b, "t1"))[0] == 200

    async def slow() -> float:
        async with http.post(b.proxy_url + "/slow?delay=1.5", headers={"X-Correlation-ID": "t1"}) as resp:
            assert resp.status == 200
            await resp.read()
        return time.monotonic()

    task = asyncio.create_task(slow())
    await wait_for(lambda: any(r.path.startswith("/slow") for r in upstream.received))
    status, _ = await api(http, "POST", a.admin_url + "/v1/sessions/t1/close")
    assert status == 200
    await wait_for(lambda: b.router.tree.get("t1")["closed"], timeout=2)  # B heard of the close
    assert (await post(http, b, "t1"))[0] == 200  # a new request on the id, answered at once
    slow_ended = await task
    await wait_for(lambda: len(finishes(upstream, "t1")) >= 1, timeout=5)
    await asyncio.sleep(0.6)
    (finish,) = finishes(upstream, "t1")
    assert finish.at >= slow_ended - 0.01  # (both time.monotonic())


TEAM = "team-a-token-0123456789"


async def test_a_store_that_lost_its_data_gets_back_the_api_sessions_replicas_hold(
    upstream, replicas, http, redis_server, tmp_path
):
    # B learned the API session from its first request; the store then restarts empty. B's
    # republish must bring it back as the API session it was: its owner reads, lists and closes
    # it on A, and the count of active API sessions (the limit: one here) holds it again.
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{"token": TEAM, "workspace": "team-a"}]}))
    a, b = await replicas(
        2,
        upstream=upstream.url,
        mode="vllm_router",
        admin_tokens_file=str(tokens),
        sessions={"api": {"max_sessions": 1}},
    )
    sessions = a.admin_url + "/v1/sessions"
    body = {"deployment": "default", "session_id": "team-a:j1", "ttl_seconds": 120}
    status, created = await api(http, "POST", sessions, body, token=TEAM)
    assert status == 201
    assert (await post(http, b, "team-a:j1"))[0] == 200
    key = replicas.prefix + "s:team-a:j1"
    await wait_for(lambda: redis_server.cli("HGET", key, "n").strip() == "1")  # B wrote its turn
    redis_server.restart_empty()
    await wait_for(lambda: redis_server.cli("EXISTS", key).strip() == "1", timeout=10)
    # (each replica meets the restart on its own calls, when they come; until its breaker closed
    # again, its writes answer 503 store_unavailable, which a client retries: so does this test)

    async def served(method: str, url: str, body: Any = None) -> tuple[int, Any]:
        return await eventually(lambda: api(http, method, url, body, token=TEAM), lambda got: got[0] != 503, timeout=10)

    status, seen = await served("GET", sessions + "/team-a:j1")
    assert status == 200, seen
    assert (seen["origin"], seen["status"], seen["workspace"]) == ("api", "active", "team-a")
    assert (seen["ttl_seconds"], seen["created_at"]) == (120, created["created_at"])
    status, listed = await served("GET", sessions)
    assert status == 200 and [s["id"] for s in listed["data"]] == ["team-a:j1"]
    status, refused = await served("POST", sessions, {"deployment": "default"})
    assert status == 429 and refused["error"]["type"] == "session_limit_reached"
    status, closed = await served("POST", sessions + "/team-a:j1/close")
    assert status == 200 and closed["status"] == "closed"
    for sc in (a, b):  # (B hears of the close by event)
        await eventually(lambda sc=sc: post(http, sc, "team-a:j1"), lambda got: got[0] == 410, timeout=2)
    # the count is exact again, and a new session is listed after the one brought back
    status, _ = await served("POST", sessions, {"deployment": "default", "session_id": "team-a:a2"})
    assert status == 201
    status, listed = await served("GET", sessions)
    assert [s["id"] for s in listed["data"]] == ["team-a:j1", "team-a:a2"]


async def test_a_create_the_store_made_is_answered_created_even_when_reading_it_back_would_fail(
    upstream, replicas, http, redis_server
):
    # The create is one atomic step in the store. A read failing right after it (a store that
    # restarts, a timeout; here deterministically: a user that may not read hashes) must not
    # answer 503 for a session that exists: the client's retry would then get 409 session_exists.
    redis_server.cli("ACL", "SETUSER", "noread", "on", ">pw", "~*", "&*", "+@all", "-hgetall")
    (a,) = await replicas(1, upstream=upstream.url, state={"url": f"redis://noread:pw@127.0.0.1:{redis_server.port}"})
    body = {"deployment": "default", "session_id": "made", "ttl_seconds": 60}
    status, created = await api(http, "POST", a.admin_url + "/v1/sessions", body)
    assert status == 201, created
    assert (created["id"], created["origin"], created["status"], created["ttl_seconds"]) == (
        "made",
        "api",
        "active",
        60,
    )
    assert (created["turns"], created["in_flight"], created["root"]) == (0, 0, "made")
    stored = redis_server.cli("HGET", replicas.prefix + "s:made", "c").strip()
    assert created["created_at"] == rfc3339(int(stored) / 1000)
    status, again = await api(http, "POST", a.admin_url + "/v1/sessions", body)
    assert status == 409 and again["error"]["type"] == "session_exists"
    status, seen = await api(http, "GET", a.admin_url + "/v1/sessions/made")
    assert status == 503 and seen["error"]["type"] == "store_unavailable"  # (reads fail for this user)


async def test_a_view_of_a_huge_tree_is_bounded_and_leaves_the_replica_on_the_store(
    upstream, replicas, http, redis_server
):
    # A parent with a flood of children (here: a few through traffic, the rest added to its
    # children set directly). The view reads a bounded part and says so; it never takes the
    # replica that serves it off the store: the next new session is shared as usual.
    import redis

    # (A store slower than timeout_ms under load would take a replica off it: not what is tested.)
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router", state={"timeout_ms": 5000})
    assert (await post(http, a, "ROOT"))[0] == 200
    for i in range(3):
        assert (await post(http, a, f"kid-{i}", parent="ROOT"))[0] == 200
    kids = replicas.prefix + "k:ROOT"
    await wait_for(lambda: redis_server.cli("SCARD", kids).strip() == "3")

    def flood() -> None:  # (off the event loop: the replicas run on it)
        with redis.Redis(port=redis_server.port) as client:
            for start in range(0, 1_000_000, 20_000):
                client.sadd(kids, *(f"flood-{i}" for i in range(start, start + 20_000)))

    await asyncio.to_thread(flood)
    assert metric(b, "sidecar_state_store_up") == 1
    redis_server.cli("CONFIG", "RESETSTAT")
    status, tree = await api(http, "GET", b.admin_url + "/v1/trees/kid-1")
    assert status == 200, tree
    assert tree["session"] == "ROOT" and tree["truncated"] is True and tree["omitted"] > 990_000
    # what the store did for it: bounded, whatever the children set holds (no SMEMBERS of a
    # million ids; one scan step per node whose children were read: the root's, and those of the
    # kids among the ids its step returned; the records of at most MAX_CHILDREN_READ children
    # and the path)
    calls = {
        m.group(1): int(m.group(2))
        for m in re.finditer(r"^cmdstat_(\S+):calls=(\d+)", redis_server.cli("INFO", "commandstats"), re.M)
    }
    # (the replicas' write-behind may run meanwhile: its scripts' commands count here too)
    assert "smembers" not in calls and "sinter" not in calls and "sunion" not in calls, calls
    assert 1 <= calls["sscan"] <= 4 and calls["hgetall"] <= MAX_CHILDREN_READ + 5, calls
    assert metric(b, "sidecar_state_store_up") == 1
    assert metric(b, "sidecar_state_ops_total", {"op": "read", "outcome": "error"}) == 0
    assert (await post(http, b, "after-view"))[0] == 200
    await wait_for(lambda: redis_server.cli("EXISTS", replicas.prefix + "s:after-view").strip() == "1", timeout=2)


async def test_a_view_whose_store_read_fails_answers_503_and_leaves_the_replica_on_the_store(
    upstream, replicas, http, redis_server
):
    # The store refuses the view's read (here: a children key of the wrong type). The view
    # answers 503 store_unavailable; the request path's breaker stays closed. (A store slower than
    # timeout_ms under load would take the replica off it: not what is tested.)
    (a,) = await replicas(1, upstream=upstream.url, mode="vllm_router", state={"timeout_ms": 5000})
    assert (await post(http, a, "R"))[0] == 200
    await wait_for(lambda: redis_server.cli("EXISTS", replicas.prefix + "s:R").strip() == "1")
    redis_server.cli("SET", replicas.prefix + "k:R", "not-a-set")
    status, body = await api(http, "GET", a.admin_url + "/v1/trees/R")
    assert status == 503 and body["error"]["type"] == "store_unavailable"
    assert metric(a, "sidecar_state_store_up") == 1
    assert (await post(http, a, "after-failed-view"))[0] == 200
    await wait_for(lambda: redis_server.cli("EXISTS", replicas.prefix + "s:after-failed-view").strip() == "1")


def _limited_user(redis_server) -> str:
    """A store user that may connect and PING but not run scripts: the URL to use it."""
    redis_server.cli("ACL", "SETUSER", "limited", "on", ">pw", "~*", "&*", "+@all", "-evalsha", "-eval", "-script")
    return f"redis://limited:pw@127.0.0.1:{redis_server.port}"


def _run_required(tmp_path, state: dict) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "listen": "127.0.0.1:0",
                "admin": "127.0.0.1:0",
                "upstream": "http://127.0.0.1:1",
                "state": {"required": True, "timeout_ms": 1000, **state},
            }
        )
    )
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_required_store_the_sidecar_cannot_use_stops_the_start_naming_what_to_fix(tmp_path, redis_server):
    password = tmp_path / "password"
    password.write_text("wrong\n")
    redis_server.cli("CONFIG", "SET", "requirepass", "right")
    proc = _run_required(tmp_path, {"url": redis_server.url, "password_file": str(password)})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("sidecar: cannot start: state.url: the shared store cannot be used (Authentication")
    assert "check the password: state.password_file, SIDECAR_STATE_PASSWORD or the URL's" in proc.stderr
    redis_server.cli("-a", "right", "--no-auth-warning", "CONFIG", "SET", "requirepass", "")
    proc = _run_required(tmp_path, {"url": _limited_user(redis_server)})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "(NoPermissionError: " in proc.stderr
    assert "the store's user needs EVALSHA, SCRIPT LOAD, PUBLISH, SUBSCRIBE and PING" in proc.stderr


async def test_a_store_user_without_script_rights_leaves_the_replica_on_local_state(
    upstream, replicas, http, redis_server
):
    # Reachable is not usable: the breaker must not close on a PING the user may run while
    # every write it then tries is refused.
    a = await replicas.one(upstream=upstream.url, mode="vllm_router", state={"url": _limited_user(redis_server)})
    assert metric(a, "sidecar_state_store_up") == 0
    assert (await post(http, a, "local"))[0] == 200
    for _ in range(15):  # past the breaker's first probes (1 s, then 2 s)
        await asyncio.sleep(0.2)
        assert metric(a, "sidecar_state_store_up") == 0
    assert metric(a, "sidecar_state_ops_total", {"op": "flush", "outcome": "error"}) == 0


async def test_replicas_whose_clocks_disagree_agree_on_idle_deadlines(upstream, replicas, http):
    # Deadlines are written and compared in the store: on one clock, the store's. B's clock runs
    # 120 s ahead; read against it, a session active on A every half second looked long idle,
    # and B's sweep ended it (finish_session) while it was in use.
    a, b = await replicas(2, upstream=upstream.url, mode="vllm_router", sessions={"idle_ttl_seconds": 2})
    b.state.clock = lambda: time.time() + 120
    await b.state._sync_clock()
    assert abs(b.state.wall() - time.time()) < 0.5  # B writes the store's time (its server runs here)
    for _ in range(10):
        assert (await post(http, a, "busy"))[0] == 200
        await asyncio.sleep(0.5)
    assert finishes(upstream, "busy") == []
    # idle for real: it expires, once, whichever replica's sweep claims it
    await wait_for(lambda: len(finishes(upstream, "busy")) == 1, timeout=8)
    await asyncio.sleep(1.2)
    assert len(finishes(upstream, "busy")) == 1
