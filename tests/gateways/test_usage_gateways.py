"""Prompt-cache accounting against gateways that report cached tokens: Dynamo 1.6.1 (KV router,
two mocker engines, whose ``usage.prompt_tokens_details.cached_tokens`` are real prefix-cache
hits) and the demo's mock gateway (``sidecar demo``'s, per-worker prefix caches). A tree of
multi-turn sessions runs through the sidecar; the sidecar's per-session and per-tree totals
(``/v1/sessions/{id}``, ``/v1/trees/{root}``) must equal the sums of what the responses the
client received said, and later turns must show cached tokens."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar.demo.gateway import MockGateway, create_gateway_app

from .procs import MODEL, Sidecar, Stack, start_sidecar, stop_all

pytestmark = [pytest.mark.gateway, pytest.mark.timeout(180)]

TURNS = 4
# A long shared system prompt: the second turn of a session extends the first's prompt, so its
# prefix (in whole KV blocks) is found cached on the worker that served the first.
SYSTEM = " ".join(f"rule {i}: keep answers short and exact." for i in range(60))


async def conversation(
    http: aiohttp.ClientSession, url: str, session: str, parent: str | None, *, ask_usage: bool
) -> list[tuple[int, int]]:
    """``TURNS`` streamed turns of one session (the history grows); each response's (prompt,
    cached) as the client read it from its usage chunk."""
    messages = [{"role": "system", "content": SYSTEM}]
    counts = []
    headers = {"X-Correlation-ID": session}
    if parent is not None:
        headers["X-Parent-Session-ID"] = parent
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"{session[:8]} turn {turn}: go on with the plan."})
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": 8}
        if ask_usage:
            body["stream_options"] = {"include_usage": True}
        usage, text = None, ""
        async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    text += (choice.get("delta") or {}).get("content") or ""
        assert usage is not None, "the response reported no usage"
        counts.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
        messages.append({"role": "assistant", "content": text or "ok"})
    return counts


async def tree_through(sidecar: Sidecar, *, ask_usage: bool) -> None:
    """A root session and three sub-agent sessions below it; the sidecar's totals must be the
    sums of what the responses said."""
    root = f"usage-root-{uuid.uuid4()}"
    kids = [f"usage-kid-{i}-{uuid.uuid4()}" for i in range(3)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        said = {root: await conversation(http, sidecar.url, root, None, ask_usage=ask_usage)}
        runs = await asyncio.gather(*(conversation(http, sidecar.url, k, root, ask_usage=ask_usage) for k in kids))
        said.update(zip(kids, runs, strict=True))
        for sid, counts in said.items():
            assert any(cached for _, cached in counts[1:]), f"{sid}: no later turn found its prefix cached: {counts}"
            async with http.get(f"{sidecar.admin_url}/v1/sessions/{sid}") as resp:
                got = (await resp.json())["prompt_cache"]
            prompt, cached = sum(p for p, _ in counts), sum(c for _, c in counts)
            assert (got["prompt_tokens"], got["cached_tokens"], got["reported_turns"], got["unknown_turns"]) == (
                prompt,
                cached,
                TURNS,
                0,
            ), sid
        async with http.get(f"{sidecar.admin_url}/v1/trees/{root}") as resp:
            tree = (await resp.json())["subtree_prompt_cache"]
    prompt = sum(p for counts in said.values() for p, _ in counts)
    cached = sum(c for counts in said.values() for _, c in counts)
    assert (tree["prompt_tokens"], tree["cached_tokens"], tree["reported_turns"]) == (prompt, cached, 4 * TURNS)
    assert tree["cached_ratio"] == pytest.approx(cached / prompt)


@pytest.fixture(scope="module")
def dynamo_sidecar(dynamo: Stack, sidecar_factory: Any) -> Sidecar:
    return sidecar_factory(dynamo.url, "dynamo_headers")


async def test_dynamo_mocker_cached_tokens_add_up_per_session_and_tree(dynamo_sidecar: Sidecar) -> None:
    await tree_through(dynamo_sidecar, ask_usage=True)


@pytest.fixture(scope="module")
def demo_gateway() -> Iterator[str]:
    """The demo's mock gateway (4 workers, Dynamo-style affinity) on a loopback port, in a thread
    of its own (the tests' event loops come and go)."""
    import threading

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(create_gateway_app(MockGateway(n_workers=4)), access_log=None)

    async def serve() -> str:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def demo_sidecar(demo_gateway: str, gateway_logs: Path) -> Iterator[Sidecar]:
    """A sidecar that asks streamed chat completions for their usage itself (``usage.include_usage``)."""
    config = gateway_logs / "usage-include.yaml"
    config.write_text("usage:\n  include_usage: true\n")
    sidecar = start_sidecar(demo_gateway, "dynamo_headers", gateway_logs, extra_args=["--config", str(config)])
    yield sidecar
    stop_all([sidecar.proc])


async def test_demo_gateway_cached_tokens_add_up_when_the_sidecar_asks_for_usage(demo_sidecar: Sidecar) -> None:
    await tree_through(demo_sidecar, ask_usage=False)
