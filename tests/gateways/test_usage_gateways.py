"""Prompt-cache accounting against gateways that report cached tokens: Dynamo 1.6.1 (KV router,
two mocker engines, whose ``usage.prompt_tokens_details.cached_tokens`` are real prefix-cache
hits) and the demo's mock gateway (``sidecar demo``'s, per-worker prefix caches). A tree of
multi-turn sessions runs through the sidecar; the sidecar's per-session and per-tree totals
(``/v1/sessions/{id}``, ``/v1/trees/{root}``) must equal the sums of what the responses the
client received said, and later turns must show cached tokens. Then real AIPerf multi-turn
sessions: the sidecar's cached ratio per turn bucket (its Prometheus counters) must be the one
computed from the raw responses AIPerf recorded."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar.demo.gateway import MockGateway, create_gateway_app
from tests.agents.isolated import is_loopback, tried_addresses
from tests.waiting import eventually

from .conftest import require_gateway
from .procs import GATEWAYS, GATEWAYS_DIR, MODEL, TINY_MODEL_DIR, Sidecar, Stack, start_sidecar, stop_all

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

        async def fetch(path: str) -> Any:
            async with http.get(f"{sidecar.admin_url}{path}") as resp:
                return await resp.json()

        # (the sidecar counts a response once it saw its end, which can come a moment after the
        # client read the last byte: read until every turn is counted)
        for sid, counts in said.items():
            assert any(cached for _, cached in counts[1:]), f"{sid}: no later turn found its prefix cached: {counts}"
            got = (
                await eventually(
                    lambda sid=sid: fetch(f"/v1/sessions/{sid}"),
                    lambda body: (
                        body["prompt_cache"]["reported_turns"] + body["prompt_cache"]["unknown_turns"] >= TURNS
                    ),
                    timeout=10,
                )
            )["prompt_cache"]
            prompt, cached = sum(p for p, _ in counts), sum(c for _, c in counts)
            assert (got["prompt_tokens"], got["cached_tokens"], got["reported_turns"], got["unknown_turns"]) == (
                prompt,
                cached,
                TURNS,
                0,
            ), sid
        tree = (await fetch(f"/v1/trees/{root}"))["subtree_prompt_cache"]
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


@pytest.fixture(scope="module")
def dynamo_asking_sidecar(dynamo: Stack, gateway_logs: Path) -> Iterator[Sidecar]:
    """A sidecar in front of Dynamo that asks streamed chat completions for their usage itself."""
    config = gateway_logs / "usage-include-dynamo.yaml"
    config.write_text("usage:\n  include_usage: true\n")
    sidecar = start_sidecar(dynamo.url, "dynamo_headers", gateway_logs, extra_args=["--config", str(config)])
    yield sidecar
    stop_all([sidecar.proc])


def turn_bucket(turn: int) -> str:
    """A 1-based turn's bucket, as the counters are labelled (written out here, not imported)."""
    return "1" if turn == 1 else "2" if turn == 2 else "3-5" if turn <= 5 else "6-10" if turn <= 10 else "11+"


def raw_usage_by_bucket(raw_jsonl: Path) -> tuple[dict[str, list[int]], int]:
    """From AIPerf's raw export: per turn bucket, the prompt and cached tokens and the responses
    its streamed responses' usage chunks said; and how many responses said none."""
    by: dict[str, list[int]] = {}
    without = 0
    for line in raw_jsonl.read_text().splitlines():
        record = json.loads(line)
        usage = None
        for response in record["responses"]:
            for packet in response.get("packets", []):
                if packet.get("name") == "data" and packet["value"].strip() != "[DONE]":
                    usage = json.loads(packet["value"]).get("usage") or usage
        if usage is None:
            without += 1
            continue
        counts = by.setdefault(turn_bucket(record["metadata"]["turn_index"] + 1), [0, 0, 0])
        counts[0] += usage["prompt_tokens"]
        counts[1] += usage["prompt_tokens_details"]["cached_tokens"]
        counts[2] += 1
    return by, without


def sidecar_usage_by_bucket(metrics: str) -> dict[str, list[int]]:
    """Per turn bucket, the sidecar's prompt and cached token counters."""
    by: dict[str, list[int]] = {}
    for name, bucket, value in re.findall(
        r'^sidecar_(prompt|cached_prompt)_tokens_total\{[^}]*turn="([^"]+)"[^}]*\} (\S+)$', metrics, re.M
    ):
        by.setdefault(bucket, [0, 0])[0 if name == "prompt" else 1] = int(float(value))
    return by


def test_aiperf_sessions_cached_ratio_per_turn_is_what_the_responses_said(
    dynamo_asking_sidecar: Sidecar, gateway_logs: Path
) -> None:
    # AIPerf 0.13.0 (streamed chat, one X-Correlation-ID per conversation, every turn sending the
    # conversation so far) through the sidecar to Dynamo: 8 conversations of 5 turns, 4 at a time.
    # It reaches nothing but loopback (no telemetry; the tokenizer is a local directory): run
    # under strace, every address it tried to reach is checked.
    require_gateway("aiperf")
    if shutil.which("strace") is None:  # (scripts/install_agents.sh installs it)
        why = "strace is not installed: it records what AIPerf tries to reach"
        if os.environ.get("CI"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    artifacts = gateway_logs / f"aiperf-{uuid.uuid4().hex[:8]}"
    trace = artifacts.with_suffix(".strace")
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1", "NO_PROXY": "*"}
    argv = [
        *("strace", "-f", "-qq", "-e", "trace=connect,sendto,sendmsg", "-o", str(trace)),
        str(GATEWAYS_DIR / GATEWAYS["aiperf"][1]),
        "profile",
        *("--model", MODEL, "--tokenizer", str(TINY_MODEL_DIR), "--url", dynamo_asking_sidecar.url),
        *("--endpoint-type", "chat", "--streaming", "--conversation-num", "8", "--conversation-turn-mean", "5"),
        *("--conversation-turn-stddev", "0", "--isl", "128", "--osl", "8", "--concurrency", "4"),
        *("--random-seed", "1", "--ui-type", "none", "--export-level", "raw", "--artifact-dir", str(artifacts)),
    ]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    tried = tried_addresses(trace)
    assert tried and all(is_loopback(address) for address in tried), sorted(set(tried))
    said, without = raw_usage_by_bucket(artifacts / "profile_export_raw.jsonl")
    assert without == 0 and sum(counts[2] for counts in said.values()) == 40, (said, without)
    assert set(said) == {"1", "2", "3-5"}
    deadline = time.monotonic() + 10  # (a response is counted once the sidecar saw its end)
    while True:
        metrics = dynamo_asking_sidecar.metrics_text()
        responses = re.findall(r"^sidecar_usage_responses_total\{[^}]*\} (\S+)$", metrics, re.M)
        if sum(float(n) for n in responses) >= 40 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    counted = sidecar_usage_by_bucket(metrics)
    assert {bucket: counts[:2] for bucket, counts in said.items()} == counted
    assert said["2"][1] > 0 and said["3-5"][1] > 0  # later turns found their conversation's prefix cached
