"""The real coding-agent clients, headless, through the sidecar with its default identity
settings: Claude Code, Codex CLI and opencode each run one prompt that makes the scripted
endpoint drive main agent -> sub-agent -> nested sub-agent -> answers (tests/agents/harness.py).

Each run checks that the client reached nothing but loopback (a network namespace of its own
where the machine allows it, and every address it tried recorded by strace), that the gateway
(the scripted endpoint, behind the sidecar's ``dynamo_headers`` mode) saw each agent as its own
session with its parent, and that ``GET /v1/trees/{root}`` shows main -> sub-agent -> nested.
Once through one sidecar, once through two replicas sharing a real Redis, the sub-agents' requests
sent to replica B and the main agent's to replica A.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.agents.conftest import require
from tests.agents.harness import CLIENTS, Client, Run, Splitter, byte_relay, run_client
from tests.agents.scripted_llm import ScriptedLLM, depth_of_request
from tests.waiting import eventually

pytestmark = [pytest.mark.agents, pytest.mark.timeout(600)]


def check_run(run: Run) -> None:
    assert run.status == 0 and "done at depth 0" in run.stdout, run.describe()
    assert run.reached_proxy, "strace recorded no connection to the proxy: " + run.describe()
    assert run.elsewhere == [], f"{run.client.name} tried to reach {run.elsewhere}"


def own_id(client: Client, depth: int, headers: dict[str, str]) -> str:
    """The session id each client's own headers name for the agent that sent them."""
    if client.name == "claude_code":
        conversation = headers["x-claude-code-session-id"]
        return conversation if depth == 0 else f"{conversation}.{headers['x-claude-code-agent-id']}"
    if client.name == "codex":
        return headers["thread-id"]
    return headers["x-session-affinity"]


def gateway_view(llm: ScriptedLLM, client: Client) -> list[str]:
    """What the gateway saw, checked request by request: the session id of each depth (main,
    sub-agent, nested), each request carrying its agent's own session and that agent's parent."""
    sessions: dict[int, str] = {}
    posts = llm.posts(client.api)
    assert posts, f"{client.name} sent no {client.api} request"
    for request in posts:
        depth = depth_of_request(request)
        assert depth is not None, f"a request carries no task marker: {request.body[:300]!r}"
        headers = {k.lower(): v for k, v in request.headers}
        session = headers.get("x-dynamo-session-id")
        assert session == own_id(client, depth, headers), (depth, headers)
        assert sessions.setdefault(depth, session) == session, f"depth {depth} in two sessions"
        parent = headers.get("x-dynamo-parent-session-id")
        assert parent == (None if depth == 0 else sessions.get(depth - 1)), (depth, headers)
    assert sorted(sessions) == [0, 1, 2], sessions
    assert len(set(sessions.values())) == 3
    return [sessions[0], sessions[1], sessions[2]]


def shape(tree: dict[str, Any]) -> dict[str, Any]:
    return {tree["session"]: {k: v for c in tree["children"] for k, v in shape(c).items()}}


async def tree(admin_url: str, root: str) -> dict[str, Any] | None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{admin_url}/v1/trees/{root}") as resp:
            return shape(await resp.json()) if resp.status == 200 else None


@pytest.mark.parametrize("name", sorted(CLIENTS))
async def test_a_real_client_builds_its_tree_through_the_sidecar(name, llm, start_sidecar):
    client = CLIENTS[name]
    require(client)
    sc = await start_sidecar(upstream=llm.url, mode="dynamo_headers")
    host, port = sc.proxy_url.removeprefix("http://").rsplit(":", 1)
    run = await run_client(client, byte_relay(host, int(port)))
    check_run(run)
    main, sub, nested = gateway_view(llm, client)
    expected = {main: {sub: {nested: {}}}}
    assert await eventually(lambda: tree(sc.admin_url, main), lambda t: t == expected) == expected


@pytest.mark.parametrize("name", sorted(CLIENTS))
async def test_a_real_client_builds_one_tree_across_two_replicas(name, llm, replicas):
    client = CLIENTS[name]
    require(client)
    a, b = await replicas(2, upstream=llm.url, mode="dynamo_headers")
    splitter = Splitter(a.proxy_url, b.proxy_url)
    run = await run_client(client, unix_site=splitter.start)
    check_run(run)
    assert "a" in splitter.went and "b" in splitter.went, splitter.went
    main, sub, nested = gateway_view(llm, client)
    expected = {main: {sub: {nested: {}}}}
    for sc in (a, b):
        assert await eventually(lambda sc=sc: tree(sc.admin_url, main), lambda t: t == expected) == expected
