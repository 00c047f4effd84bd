"""The coding-agent clients' recorded requests (tests/client_headers.py) replayed on the wire
through a sidecar with the default identity settings: the tree each conversation builds
(``GET /v1/trees/{root}``), and what each mode sends the gateway for the main agent and for
every sub-agent (its own session, its parent, the conversation's root), end actions included."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import pytest
import yaml

from tests.client_headers import CLAUDE_CODE, CODEX, OPENCODE, Headers
from tests.modes.wire import settled
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]


def header(headers: Headers, name: str) -> str:
    return next(v for k, v in headers if k.lower() == name)


def claude_code() -> tuple[list[Headers], list[tuple[str, str | None, str]]]:
    conv = header(CLAUDE_CODE[0], "x-claude-code-session-id")
    a1, a2, a3 = (f"{conv}.{header(CLAUDE_CODE[i], 'x-claude-code-agent-id')}" for i in (1, 2, 4))
    return CLAUDE_CODE, [
        (conv, None, conv),
        (a1, conv, conv),
        (a2, a1, conv),
        (a1, conv, conv),
        (a3, a1, conv),
        (a1, conv, conv),
        (conv, None, conv),
    ]


def codex() -> tuple[list[Headers], list[tuple[str, str | None, str]]]:
    t0, t1, t2 = (header(CODEX[i], "thread-id") for i in (0, 1, 4))
    return CODEX, [
        (t0, None, t0),
        (t1, t0, t0),
        (t0, None, t0),
        (t1, t0, t0),
        (t2, t1, t0),
        (t1, t0, t0),
        (t0, None, t0),
    ]


def opencode() -> tuple[list[Headers], list[tuple[str, str | None, str]]]:
    o0, o1, o2 = (header(OPENCODE[i], "x-session-affinity") for i in (0, 2, 3))
    return OPENCODE, [(o0, None, o0), (o0, None, o0), (o1, o0, o0), (o2, o1, o0), (o1, o0, o0), (o0, None, o0)]


CLIENTS = {
    "claude_code": (claude_code, "/v1/messages?beta=true"),
    "codex": (codex, "/v1/responses"),
    "opencode": (opencode, "/v1/chat/completions"),
}


async def replay(sc: Any, requests: list[Headers], lineage: list[tuple[str, str | None, str]], path: str) -> None:
    """Send the requests in order, each once the sidecar finished the one before."""
    async with aiohttp.ClientSession() as http:
        for headers, (session, _, _) in zip(requests, lineage, strict=True):
            sent = [(k, v) for k, v in headers if k.lower() not in ("connection", "accept-encoding")]
            async with http.post(sc.proxy_url + path, data=b'{"model":"m","stream":false}', headers=sent) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
            await settled(sc, session)


def shape(tree: dict[str, Any]) -> dict[str, Any]:
    return {tree["session"]: {k: v for c in tree["children"] for k, v in shape(c).items()}}


async def admin_tree(sc: Any, root: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{sc.admin_url}/v1/trees/{root}") as resp:
            assert resp.status == 200, await resp.text()
            return shape(await resp.json())


def expected_tree(lineage: list[tuple[str, str | None, str]]) -> dict[str, Any]:
    nodes: dict[str, dict[str, Any]] = {}
    top = None
    for session, parent, _ in lineage:
        node = nodes.setdefault(session, {})
        if parent is None:
            top = session
        else:
            nodes.setdefault(parent, {})[session] = node
    assert top is not None
    return {top: nodes[top]}


@pytest.mark.parametrize("client", sorted(CLIENTS))
async def test_dynamo_sees_each_agent_as_its_own_session_with_its_parent(upstream, start_sidecar, client):
    make, path = CLIENTS[client]
    requests, lineage = make()
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    await replay(sc, requests, lineage, path)
    got = [(r.all("X-Dynamo-Session-ID"), r.all("X-Dynamo-Parent-Session-ID")) for r in upstream.received]
    assert got == [([s], [] if p is None else [p]) for s, p, _ in lineage]
    root = lineage[0][0]
    assert await admin_tree(sc, root) == expected_tree(lineage)
    # the client's own headers reach the gateway as sent
    for sent, received in zip(requests, upstream.received):
        for name, value in sent:
            if name.lower().startswith(
                ("x-claude-code-", "x-codex-", "thread-", "session-", "x-session-", "x-parent-")
            ):
                assert received.all(name) == [value]


@pytest.mark.parametrize("client", sorted(CLIENTS))
async def test_tree_scoped_modes_key_every_agent_on_the_conversation(upstream, start_sidecar, client):
    make, path = CLIENTS[client]
    requests, lineage = make()
    sc = await start_sidecar(upstream=upstream.url, mode="smg_routing_key", mode_opt=["scope=tree"])
    await replay(sc, requests, lineage, path)
    assert [r.all("X-SMG-Routing-Key") for r in upstream.received] == [[root] for _, _, root in lineage]


@pytest.mark.parametrize("client", sorted(CLIENTS))
async def test_identity_headers_carry_session_parent_and_root(upstream, start_sidecar, client):
    make, path = CLIENTS[client]
    requests, lineage = make()
    sc = await start_sidecar(
        upstream=upstream.url, mode="identity_headers", mode_opt=["session=X-S", "parent=X-P", "root=X-R"]
    )
    await replay(sc, requests, lineage, path)
    got = [(r.all("X-S"), r.all("X-P"), r.all("X-R")) for r in upstream.received]
    assert got == [([s], [] if p is None else [p], [r]) for s, p, r in lineage]


async def test_end_actions_name_the_scoped_agent_sessions(upstream, start_sidecar):
    requests, lineage = claude_code()
    sc = await start_sidecar(upstream=upstream.url, mode="vllm_router")
    await replay(sc, requests, lineage, CLIENTS["claude_code"][1])
    sessions = list(dict.fromkeys(s for s, _, _ in lineage))
    assert [r.all("x-session-id") for r in upstream.received] == [[s] for s, _, _ in lineage]
    async with aiohttp.ClientSession() as http:
        for sid in reversed(sessions):
            async with http.post(f"{sc.admin_url}/v1/sessions/{sid}/close") as resp:
                assert resp.status == 200, await resp.text()

    def finished() -> list[str]:
        return [
            parse_qs(urlsplit(r.path).query)["session_id"][0]
            for r in upstream.received
            if r.path.startswith("/finish_session")
        ]

    await wait_for(lambda: len(finished()) == len(sessions))
    assert sorted(finished()) == sorted(sessions)


async def test_llmd_header_affinity_sends_each_agents_session_and_echoes_nothing(upstream, start_sidecar):
    """config/examples/llmd.yaml (llm-d's session_id_header algorithm): every request of a
    session carries `x-session-token: <session>`, its first one included; the upstream's own
    `x-session-token` answers are never echoed, a client's copy never forwarded."""
    example = yaml.safe_load((ROOT / "config" / "examples" / "llmd.yaml").read_text())
    options = [f"{k}={v}" for k, v in example["mode_options"].items()]
    requests, lineage = claude_code()
    sc = await start_sidecar(upstream=upstream.url, mode=example["mode"], mode_opt=options)
    spoofed = [[*headers, ("x-session-token", "from-client")] for headers in requests]
    # /llmd answers with an x-session-token of its own, as an endpoint picker that issues tokens
    await replay(sc, spoofed, lineage, "/llmd?token=picker-token")
    assert [r.all("x-session-token") for r in upstream.received] == [[s] for s, _, _ in lineage]
