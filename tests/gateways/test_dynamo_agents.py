"""Coding-agent clients' sub-agents on NVIDIA Dynamo 1.6.1 (frontend ``--router-mode kv
--router-session-affinity-ttl-secs 60``, two mocker engines), through the sidecar's
``dynamo_headers`` mode, with the clients' own headers forwarded.

Dynamo 1.6.1 reads agent clients' headers itself when no ``X-Dynamo-Session-ID`` comes
(``x-claude-code-session-id`` with ``x-claude-code-agent-id``, ``thread-id``, ``x-session-id``):
these tests show that with those headers forwarded, Dynamo pins each agent by the session the
sidecar sends, so the sidecar forwards them unchanged (docs/gateways.md). Which worker served is
``nvext.worker_id.decode_worker_id``; a worker holding a long prompt prefix in its KV cache is
where Dynamo's KV router places a new session whose prompt starts with it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import aiohttp
import pytest

from tests.client_headers import CLAUDE_CODE, CODEX, ID_HEADERS, OPENCODE, Headers

from .procs import DYNAMO_WORKER_ID_BODY, MODEL, Sidecar, Stack

pytestmark = [pytest.mark.gateway, pytest.mark.timeout(180)]

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def prompt(seed: str, words: int = 400) -> str:
    """A long prompt of its own (a few thousand tokens: many KV blocks)."""
    return " ".join(f"{WORDS[k % len(WORDS)]}{seed}" for k in range(words))


async def worker(url: str, headers: dict[str, str] | Headers, text: str) -> str:
    """Send one chat request; the Dynamo worker that served it."""
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": text}], **DYNAMO_WORKER_ID_BODY}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            raw = await resp.text()
            assert resp.status == 200, raw
    return str(json.loads(raw)["nvext"]["worker_id"]["decode_worker_id"])


@pytest.fixture(scope="module")
def dynamo_sidecar(dynamo: Stack, sidecar_factory: Any) -> Sidecar:
    return sidecar_factory(dynamo.url, "dynamo_headers")


@pytest.fixture(scope="module")
def tree_sidecar(dynamo: Stack, sidecar_factory: Any) -> Sidecar:
    """Every session of a tree under its root's id (one worker per conversation)."""
    return sidecar_factory(dynamo.url, "session_id_header", {"header_name": "X-Dynamo-Session-ID", "scope": "tree"})


async def elsewhere(dynamo: Stack, taken: str, tag: str) -> tuple[str, str, str]:
    """A long prompt prefix held in the KV cache of a worker other than ``taken``, that worker,
    and the session id pinned there: new sessions, each with a prefix of its own (one already
    cached would pull the next to its worker), until one lands there."""
    for attempt in range(40):
        text, key = prompt(f"{tag}{attempt}"), f"warm-{uuid.uuid4()}"
        served = await worker(dynamo.url, {"X-Dynamo-Session-ID": key}, text)
        if served != taken:
            return text, served, key
    pytest.fail(f"Dynamo placed 40 new sessions on worker {taken}: no second worker")


def claude(conversation: str, agent: str | None = None, parent: str | None = None) -> dict[str, str]:
    headers = {"x-claude-code-session-id": conversation}
    if agent is not None:
        headers["x-claude-code-agent-id"] = agent
    if parent is not None:
        headers["x-claude-code-parent-agent-id"] = parent
    return headers


async def test_direct_dynamo_session_id_wins_over_claude_code_headers(dynamo: Stack) -> None:
    """Why the sidecar forwards the clients' headers unchanged: with an X-Dynamo-Session-ID,
    Dynamo places a request by that id, whatever Claude Code headers come with it."""
    first = f"pin-{uuid.uuid4()}"
    first_prompt = prompt(f"d{first}")
    one = await worker(dynamo.url, {"X-Dynamo-Session-ID": first}, first_prompt)
    shared, other, second = await elsewhere(dynamo, one, first)
    headers = claude(str(uuid.uuid4()), uuid.uuid4().hex[:17])
    # The same Claude Code headers, each time against the KV pull of the prompt's prefix: the
    # request goes where its X-Dynamo-Session-ID is pinned.
    assert await worker(dynamo.url, {**headers, "X-Dynamo-Session-ID": first}, f"{shared} a") == one
    assert await worker(dynamo.url, {**headers, "X-Dynamo-Session-ID": second}, f"{first_prompt} b") == other


async def test_each_claude_code_agent_is_pinned_by_the_sidecars_session(dynamo: Stack, dynamo_sidecar: Sidecar) -> None:
    """Through the sidecar (X-Dynamo-Session-ID `<conversation>.<agent>`, the client's headers
    forwarded): each agent is a session of its own, not pinned with its conversation, and stays
    on its worker whatever the KV cache of the other worker holds."""
    conversation, first, nested = str(uuid.uuid4()), uuid.uuid4().hex[:17], uuid.uuid4().hex[:17]
    main_prompt = prompt(f"m{first}")
    main = await worker(dynamo_sidecar.url, claude(conversation), main_prompt)
    shared, other, _ = await elsewhere(dynamo, main, first)
    # The agents' first turns start with the prefix the other worker holds: new sessions placed
    # there by KV overlap, not on their conversation's worker.
    agent_turns = [await worker(dynamo_sidecar.url, claude(conversation, first), f"{shared} agent")]
    nested_turns = [await worker(dynamo_sidecar.url, claude(conversation, nested, first), f"{shared} nested")]
    # Later turns start with the main conversation's prefix (KV overlap now pulls to its worker):
    # pinned, they stay; and the conversation stays on its own worker against the other pull.
    for n in range(3):
        agent_turns.append(await worker(dynamo_sidecar.url, claude(conversation, first), f"{main_prompt} a{n}"))
        nested_turns.append(
            await worker(dynamo_sidecar.url, claude(conversation, nested, first), f"{main_prompt} n{n}")
        )
    main_turns = [await worker(dynamo_sidecar.url, claude(conversation), f"{shared} main {n}") for n in range(3)]
    assert agent_turns == [other] * 4
    assert nested_turns == [other] * 4
    assert main_turns == [main] * 3


async def test_tree_scope_keeps_a_whole_conversation_on_one_worker(dynamo: Stack, tree_sidecar: Sidecar) -> None:
    """With the tree's root as the session id (`session_id_header`, `scope: tree`), the
    conversation and all its agents share its worker, against the KV pull of the other."""
    conversation, first, nested = str(uuid.uuid4()), uuid.uuid4().hex[:17], uuid.uuid4().hex[:17]
    main = await worker(tree_sidecar.url, claude(conversation), prompt(f"t{first}"))
    shared, _, _ = await elsewhere(dynamo, main, f"t{first}")
    served = [
        await worker(tree_sidecar.url, claude(conversation, first), f"{shared} agent"),
        await worker(tree_sidecar.url, claude(conversation, nested, first), f"{shared} nested"),
        await worker(tree_sidecar.url, claude(conversation), f"{shared} main"),
    ]
    assert served == [main] * 3


async def test_every_agent_of_the_recorded_clients_stays_on_one_worker(dynamo_sidecar: Sidecar) -> None:
    """The three clients' recorded requests (main, sub-agent, nested sub-agent, in the order
    they were sent) replayed through the sidecar, each agent's conversation growing per turn."""
    conversations: dict[str, list[str]] = {}
    for client, requests in (("claude", CLAUDE_CODE), ("codex", CODEX), ("opencode", OPENCODE)):
        run = uuid.uuid4().hex[:8]  # fresh ids per run: Dynamo's pins outlive a module
        for n, headers in enumerate(requests):
            sent = [(k, _fresh(k, v, run)) for k, v in headers if k.lower() not in ("connection", "accept-encoding")]
            key = (
                client
                + "|"
                + "|".join(v for k, v in sent if k.lower() in ("x-claude-code-agent-id", "thread-id", "x-session-id"))
            )
            served = await worker(dynamo_sidecar.url, sent, prompt(f"{key}") + f" turn {n}")
            conversations.setdefault(key, []).append(served)
    assert len(conversations) == 4 + 3 + 3  # Claude Code: main + 3 agents; Codex and opencode: 3 each
    moved = {key: workers for key, workers in conversations.items() if len(set(workers)) > 1}
    assert not moved, moved


def _fresh(name: str, value: str, run: str) -> str:
    """A recorded id made unique to this run (the same recorded id maps to the same new one)."""
    return f"{value}-{run}" if name.lower() in ID_HEADERS else value
