"""The demo's multi-turn streaming workload: concurrent chat sessions, turns of a session in order.

Each session is a conversation with a shared system prompt. Every turn sends the whole
conversation so far (so each prompt extends the previous one, as a chat client's does) with
``X-Correlation-ID: <uuid of the session>`` and a fresh ``X-Request-ID``, streams the answer,
and appends the assistant's reply and a new user message. One ``ClientSession`` serves every
request; each request has a timeout, and a session stops at its first failed turn (its
conversation can no longer be continued faithfully). Conversations are a function of ``seed``,
so two runs with the same seed send the same prompts.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from sidecar.demo.gateway import MODEL_NAME, X_WORKER_ID
from sidecar.headers import CONTENT_TYPE, X_CORRELATION_ID, X_REQUEST_ID

_VOCAB: tuple[str, ...] = (
    "summarize",
    "the",
    "latest",
    "deployment",
    "logs",
    "and",
    "explain",
    "why",
    "requests",
    "slow",
    "down",
    "under",
    "load",
    "compare",
    "two",
    "options",
    "for",
    "caching",
    "list",
    "risks",
    "of",
    "rolling",
    "back",
    "draft",
    "a",
    "short",
    "plan",
    "with",
    "steps",
    "check",
    "config",
    "files",
    "find",
    "errors",
    "in",
    "service",
    "metrics",
    "describe",
    "trend",
    "suggest",
    "next",
    "action",
    "what",
    "changed",
    "since",
    "yesterday",
    "please",
    "focus",
)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request of the workload, as the client saw it."""

    session: int
    turn: int
    worker: str | None
    prompt_tokens: int
    cached_tokens: int
    latency_s: float
    ok: bool
    error: str | None = None


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_VOCAB) for _ in range(n))


def _session_id(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


async def _one_request(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], correlation_id: str
) -> tuple[str | None, str, int, int]:
    """Send one streaming chat request; returns (worker, reply text, prompt, cached tokens)."""
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 32,
    }
    headers = {X_CORRELATION_ID: correlation_id, X_REQUEST_ID: str(uuid.uuid4()), CONTENT_TYPE: "application/json"}
    async with http.post(url, data=orjson.dumps(body), headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        parts: list[str] = []
        usage: dict[str, Any] | None = None
        done = False
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = orjson.loads(data)
            for choice in chunk.get("choices") or ():
                parts.append((choice.get("delta") or {}).get("content") or "")
            if chunk.get("usage"):
                usage = chunk["usage"]
        if not done:
            raise RuntimeError("stream ended before [DONE]")
        if not isinstance(usage, dict):
            raise RuntimeError("no usage in stream")
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens", 0)) if isinstance(details, dict) else 0
        return resp.headers.get(X_WORKER_ID), "".join(parts), int(usage["prompt_tokens"]), cached


async def _run_session(
    http: aiohttp.ClientSession,
    url: str,
    index: int,
    turns: int,
    seed: int,
    system_prompt: str,
    records: list[RequestRecord],
) -> None:
    rng = random.Random(seed * 1_000_003 + index)
    correlation_id = _session_id(rng)
    messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt}]
    for turn in range(turns):
        messages.append({"role": "user", "content": _words(rng, rng.randint(24, 40))})
        start = time.perf_counter()
        try:
            worker, reply, prompt_tokens, cached = await _one_request(http, url, messages, correlation_id)
        except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError, KeyError, TypeError) as exc:
            records.append(
                RequestRecord(
                    index, turn, None, 0, 0, time.perf_counter() - start, False, f"{type(exc).__name__}: {exc}"[:200]
                )
            )
            return
        records.append(RequestRecord(index, turn, worker, prompt_tokens, cached, time.perf_counter() - start, True))
        messages.append({"role": "assistant", "content": reply})


async def run_workload(
    base_url: str,
    *,
    sessions: int,
    turns: int,
    seed: int = 0,
    request_timeout_s: float = 10.0,
) -> list[RequestRecord]:
    """Run ``sessions`` concurrent conversations of ``turns`` streaming turns against
    ``base_url`` (``http://host:port``); returns one record per request sent."""
    if sessions < 1 or turns < 1:
        raise ValueError("sessions and turns must be >= 1")
    url = base_url.rstrip("/") + "/v1/chat/completions"
    system_prompt = _words(random.Random(seed), 40)
    records: list[RequestRecord] = []
    connector = aiohttp.TCPConnector(limit=sessions)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        async with asyncio.TaskGroup() as tg:
            for i in range(sessions):
                tg.create_task(_run_session(http, url, i, turns, seed, system_prompt, records))
    records.sort(key=lambda r: (r.session, r.turn))
    return records


async def probe_pairs(direct_url: str, via_url: str, *, pairs: int = 400) -> tuple[list[float], list[float]]:
    """Latencies (ms) of ``pairs`` pairs of small sequential requests: one to ``direct_url``, one
    to ``via_url``, back to back, each on its own keep-alive connection, the first of a pair
    alternating between them (so neither always runs on a cache the other warmed).

    Run with nothing else in flight, so the difference within a pair is the proxy's own cost
    rather than event-loop contention with the concurrent workload or a drift of the machine
    between two separate measurements.
    """
    direct: list[float] = []
    via: list[float] = []
    headers = {X_CORRELATION_ID: f"probe-{uuid.uuid4()}"}
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as to_direct,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as to_via,
    ):
        legs = ((to_direct, direct_url, direct), (to_via, via_url, via))
        for i in range(pairs):
            for session, url, out in legs if i % 2 == 0 else legs[::-1]:
                start = time.perf_counter()
                async with session.get(f"{url}/v1/models", headers=headers) as resp:
                    await resp.read()
                out.append((time.perf_counter() - start) * 1000)
    return direct, via
