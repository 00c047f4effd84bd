"""Prompt-cache accounting shared through a real redis-server: each replica's turns add their
usage to the session's record, written behind with its other changes (``Router.on_usage`` is
synchronous: no round trip on the request path), read back by
the sessions API and the tree views of every replica; fields only once non-zero; a final turn's
usage kept with its ended session; totals republished to a store that lost its data.

The responses' usage reaches the router as an engine hands it (tests/usage_support.py)."""

from __future__ import annotations

from typing import Any

from sidecar.lineage import prompt_cache as counts
from tests import usage_samples as s
from tests.state.fleet import api
from tests.usage_support import play_turn
from tests.waiting import eventually, wait_for


def chat(prompt: int, cached: int | None) -> bytes:
    return s.chat_stream(s.chat_usage(prompt, cached))


def fields(redis_server: Any, key: str) -> dict[str, str]:
    flat = redis_server.cli("HGETALL", key).split()
    return dict(zip(flat[::2], flat[1::2], strict=True))


async def test_a_sessions_usage_is_summed_over_the_replicas_that_served_it(upstream, replicas, http):
    a, b = await replicas(2, upstream=upstream.url, mode="dynamo_headers")
    await play_turn(a.router, "u", chat(1000, 0))
    await play_turn(a.router, "u", chat(1200, 1000))
    await eventually(
        lambda: api(http, "GET", b.admin_url + "/v1/sessions/u"),
        lambda got: got[0] == 200 and got[1]["prompt_cache"] == counts(2200, 1000, 2, 0),
        timeout=4,
    )
    await play_turn(b.router, "u", chat(1500, 1200))  # loaded here, then its own increments
    await play_turn(b.router, "u", s.chat_stream(None))
    await play_turn(b.router, "kid", chat(300, 0), parent="u")
    for sc in (a, b):
        await eventually(
            lambda sc=sc: api(http, "GET", sc.admin_url + "/v1/sessions/u"),
            lambda got: got[0] == 200 and got[1]["prompt_cache"] == counts(3700, 2200, 3, 1) and got[1]["turns"] == 4,
            timeout=4,
        )
        status, tree = await eventually(
            lambda sc=sc: api(http, "GET", sc.admin_url + "/v1/trees/kid"),
            lambda got: got[0] == 200 and got[1]["subtree_prompt_cache"] == counts(4000, 2200, 4, 1),
            timeout=4,
        )
        (kid,) = tree["children"]
        assert kid["prompt_cache"] == kid["subtree_prompt_cache"] == counts(300, 0, 1, 0)
        status, data = await eventually(
            lambda sc=sc: api(http, "GET", sc.admin_url + "/ui/data.json"),
            lambda got: got[0] == 200 and got[1]["trees"] and got[1]["trees"][0]["tree"]["session"] == "u",
        )
        assert data["trees"][0]["tree"]["subtree_prompt_cache"] == counts(4000, 2200, 4, 1)


async def test_accounting_fields_are_written_only_once_non_zero(upstream, replicas, redis_server):
    (a,) = await replicas(1, upstream=upstream.url, mode="dynamo_headers")
    key = replicas.prefix + "s:"
    await play_turn(a.router, "quiet", chat(9, 9), status=503)  # not accounted
    await play_turn(a.router, "unknown", chat(9, None))
    await play_turn(a.router, "counted", chat(90, 64))
    await wait_for(lambda: fields(redis_server, key + "counted").get("pt") == "90", timeout=4)
    await wait_for(lambda: "uu" in fields(redis_server, key + "unknown"), timeout=4)
    quiet, unknown, counted = (fields(redis_server, key + sid) for sid in ("quiet", "unknown", "counted"))
    assert quiet["n"] == "1" and not {"pt", "ct", "ut", "uu"} & set(quiet)
    assert unknown["uu"] == "1" and not {"pt", "ct", "ut"} & set(unknown)
    assert (counted["pt"], counted["ct"], counted["ut"]) == ("90", "64", "1") and "uu" not in counted


async def test_a_final_turns_usage_stays_with_its_ended_session(upstream, replicas, http):
    a, b = await replicas(2, upstream=upstream.url, mode="dynamo_headers")
    await play_turn(a.router, "fin", chat(100, 0))
    await play_turn(a.router, "fin", chat(160, 100), extra_headers={"x-session-final": "true"})
    status, got = await eventually(
        lambda: api(http, "GET", b.admin_url + "/v1/sessions/fin"),
        lambda got: got[0] == 200 and got[1]["end_reason"] == "final_turn_completed",
        timeout=6,
    )
    assert got["prompt_cache"] == counts(260, 100, 2, 0)


async def test_a_store_that_lost_its_data_gets_the_totals_back(upstream, replicas, http, redis_server):
    a, b = await replicas(2, upstream=upstream.url, mode="dynamo_headers")
    await play_turn(a.router, "lost", chat(500, 0))
    await play_turn(a.router, "lost", chat(600, 500))
    await play_turn(a.router, "lost", s.chat_stream(None))
    key = replicas.prefix + "s:lost"
    await wait_for(lambda: fields(redis_server, key).get("uu") == "1", timeout=4)
    redis_server.restart_empty()
    await wait_for(lambda: fields(redis_server, key).get("pt") == "1100", timeout=20)
    status, got = await eventually(
        lambda: api(http, "GET", b.admin_url + "/v1/sessions/lost"),
        lambda got: got[0] == 200 and got[1]["prompt_cache"] == counts(1100, 500, 2, 1),
        timeout=10,
    )


async def test_usage_not_written_yet_is_counted_once_when_the_store_lost_its_data(upstream, replicas, redis_server):
    # A turn's usage is pending when the replica republishes its session to a store that lost its
    # data: the republished totals leave it out and its increments follow (it was counted twice).
    # The writer's tick is long, so the flushes here are the test's own.
    (a,) = await replicas(1, upstream=upstream.url, mode="dynamo_headers", state={"flush_interval_ms": 1000})
    key = replicas.prefix + "s:again"
    await play_turn(a.router, "again", chat(500, 0))
    await a.state.flush_pending()
    assert fields(redis_server, key)["pt"] == "500"
    redis_server.restart_empty()
    await play_turn(a.router, "again", chat(600, 500))

    async def found_missing() -> bool:  # a write met the empty store: the session is to republish
        await a.state.flush_pending()
        return "again" in a.state._republish or fields(redis_server, key).get("pt") is not None

    await eventually(found_missing, lambda found: found, timeout=20)
    await play_turn(a.router, "again", chat(700, 600))  # pending when the republish is written
    await eventually(a.state.flush_pending, lambda _: int(fields(redis_server, key).get("ut", 0)) >= 3, timeout=10)
    got = fields(redis_server, key)
    assert (got["pt"], got["ct"], got["ut"]) == ("1800", "1100", "3")
