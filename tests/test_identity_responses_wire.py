"""Responses API signals on the wire, against a scripted Responses endpoint
(tests/agents/scripted_llm.py, which names each response ``resp_<n>``): ``previous_response_id``
chaining (the session that produced a response is continued by a request naming it; an unknown
one starts a new session, never an error) and ``conversation``, streamed and not, on both
engines. Opt-in: without the signal configured no body is read and no response either."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from sidecar.router import CHAIN_PREFIX
from tests.agents.scripted_llm import ScriptedLLM
from tests.modes.wire import settled


@pytest.fixture
async def llm():
    server = await ScriptedLLM().start()
    yield server
    await server.stop()


async def respond(sc: Any, body: dict[str, Any], headers: dict[str, str] | None = None) -> str:
    """POST /v1/responses; the id of the response the client got."""
    async with aiohttp.ClientSession() as http:
        async with http.post(sc.proxy_url + "/v1/responses", json=body, headers=headers or {}) as resp:
            raw = await resp.read()
            assert resp.status == 200, raw
    if body.get("stream"):
        first = next(line for line in raw.split(b"\n") if line.startswith(b"data:"))
        return str(orjson.loads(first[5:])["response"]["id"])
    return str(orjson.loads(raw)["id"])


def gateway_sessions(llm: ScriptedLLM) -> list[str | None]:
    return [r.header("X-Dynamo-Session-ID") for r in llm.posts("/v1/responses")]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_previous_response_id_continues_the_session_that_produced_it(llm, start_sidecar, stream):
    sc = await start_sidecar(
        upstream=llm.url, mode="dynamo_headers", identity={"body": ["conversation", "previous_response_id"]}
    )

    async def turn(previous: str | None) -> str:
        body: dict[str, Any] = {"model": "m", "input": "hi", "stream": stream}
        if previous is not None:
            body["previous_response_id"] = previous
        rid = await respond(sc, body)
        await settled(sc, gateway_sessions(llm)[-1] or "")
        return rid

    a1 = await turn(None)
    b1 = await turn(None)
    a2 = await turn(a1)
    b2 = await turn(b1)
    await turn(a2)
    await turn("resp_never_seen")  # unknown: a new session, not an error
    await turn(b2)
    a, b, a_, b_, a__, unknown, b__ = gateway_sessions(llm)
    assert a == a_ == a__ and b == b_ == b__
    assert len({a, b, unknown}) == 3
    assert all(s is not None and s.startswith(CHAIN_PREFIX) for s in (a, b, unknown))
    assert sc.router.tree.get(a)["turns"] == 3 and sc.router.tree.get(b)["turns"] == 3


async def test_conversation_names_the_session(llm, start_sidecar):
    sc = await start_sidecar(
        upstream=llm.url, mode="dynamo_headers", identity={"body": ["conversation", "previous_response_id"]}
    )
    await respond(sc, {"model": "m", "input": "hi", "conversation": "conv_1"})
    first = await respond(sc, {"model": "m", "input": "hi", "conversation": {"id": "conv_2"}, "stream": True})
    # a conversation wins over previous_response_id (listed first); its response is not read
    await respond(sc, {"model": "m", "input": "hi", "conversation": "conv_1", "previous_response_id": first})
    assert gateway_sessions(llm) == ["conv_1", "conv_2", "conv_1"]
    assert len(sc.router.state.responses) == 0


async def test_a_header_session_wins_and_its_response_is_not_read(llm, start_sidecar):
    sc = await start_sidecar(upstream=llm.url, mode="dynamo_headers", identity={"body": ["previous_response_id"]})
    rid = await respond(sc, {"model": "m", "input": "hi", "stream": True}, {"X-Correlation-ID": "corr"})
    await respond(sc, {"model": "m", "input": "hi", "previous_response_id": rid}, {"X-Correlation-ID": "corr"})
    assert gateway_sessions(llm) == ["corr", "corr"]
    assert len(sc.router.state.responses) == 0


async def test_responses_signals_are_off_unless_configured(llm, start_sidecar):
    sc = await start_sidecar(upstream=llm.url, mode="dynamo_headers")
    rid = await respond(sc, {"model": "m", "input": "hi", "conversation": "c", "stream": True})
    await respond(sc, {"model": "m", "input": "hi", "previous_response_id": rid})
    assert gateway_sessions(llm) == [None, None]
    assert len(sc.router.state.responses) == 0
