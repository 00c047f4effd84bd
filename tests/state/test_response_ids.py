"""Responses API chaining (``identity.body: [previous_response_id]``) across replicas sharing a
Redis: a response id one replica read is known to the others (key ``rid:<id>``, with a TTL), so
a chained request continues its session on whichever replica it reaches."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from sidecar.router import CHAIN_PREFIX
from tests.agents.scripted_llm import ScriptedLLM
from tests.modes.wire import settled
from tests.waiting import eventually, wait_for

CHAINED = {"identity": {"body": ["previous_response_id"]}, "sessions": {"response_ids_ttl_seconds": 120}}


@pytest.fixture
async def llm():
    server = await ScriptedLLM().start()
    yield server
    await server.stop()


async def respond(http: aiohttp.ClientSession, sc: Any, previous: str | None, stream: bool) -> str:
    body: dict[str, Any] = {"model": "m", "input": "hi", "stream": stream}
    if previous is not None:
        body["previous_response_id"] = previous
    async with http.post(sc.proxy_url + "/v1/responses", json=body) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
    if stream:
        first = next(line for line in raw.split(b"\n") if line.startswith(b"data:"))
        return str(orjson.loads(first[5:])["response"]["id"])
    return str(orjson.loads(raw)["id"])


def sessions(llm: ScriptedLLM) -> list[str | None]:
    return [r.header("X-Dynamo-Session-ID") for r in llm.posts("/v1/responses")]


async def stored(redis_server: Any, prefix: str, response_id: str) -> None:
    """The replica that read ``response_id`` has written it (behind)."""
    await wait_for(lambda: redis_server.cli("EXISTS", prefix + "rid:" + response_id).strip() == "1")


async def test_a_chain_continues_its_session_on_any_replica(llm, replicas, redis_server, http):
    a, b = await replicas(2, upstream=llm.url, mode="dynamo_headers", **CHAINED)
    prefix = replicas.prefix
    r1 = await respond(http, a, None, stream=True)
    await stored(redis_server, prefix, r1)
    r2 = await respond(http, b, r1, stream=False)  # B never saw r1
    await stored(redis_server, prefix, r2)
    await respond(http, a, r2, stream=True)  # A never saw r2
    await respond(http, b, "resp_unknown", stream=False)  # unknown: a new session, not an error
    first, second, third, unknown = sessions(llm)
    assert first == second == third and first is not None and first.startswith(CHAIN_PREFIX)
    assert unknown is not None and unknown.startswith(CHAIN_PREFIX) and unknown != first
    ttl = int(redis_server.cli("TTL", prefix + "rid:" + r2))
    assert 0 < ttl <= 120
    assert redis_server.cli("GET", prefix + "rid:" + r2).strip() == f"default {first}"
    # the session's turns, counted across the replicas
    await settled(a, first)
    await settled(b, first)

    async def turns() -> int:
        async with http.get(f"{a.admin_url}/v1/sessions/{first}") as resp:
            return int((await resp.json()).get("turns", 0)) if resp.status == 200 else 0

    assert await eventually(turns, lambda n: n == 3) == 3


async def test_an_id_the_store_does_not_hold_starts_a_new_session(llm, replicas, redis_server, http):
    a, b = await replicas(2, upstream=llm.url, mode="dynamo_headers", **CHAINED)
    r1 = await respond(http, a, None, stream=False)
    await stored(redis_server, replicas.prefix, r1)
    redis_server.cli("FLUSHALL")  # the store lost it (as a store restarted empty would)
    await respond(http, b, r1, stream=True)
    await respond(http, a, r1, stream=True)  # A still knows it: its session goes on
    first, on_b, on_a = sessions(llm)
    assert on_b != first and on_b is not None and on_b.startswith(CHAIN_PREFIX)
    assert on_a == first
