"""``sidecar demo``: the mock gateway's routing and prefix cache on the wire, the report, and the
full demo run through the real sidecar (and through a minimal stand-in proxy)."""

from __future__ import annotations

import asyncio
import io
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from sidecar.demo import DemoResult, run_demo
from sidecar.demo.gateway import (
    BLOCK_SIZE,
    GATEWAY_KEY,
    X_WORKER_ID,
    MockGateway,
    PrefixCache,
    create_gateway_app,
    render_chat,
    reply_words,
)
from sidecar.demo.report import AddedLatency, RunMetrics, added_latency, count_switches, format_table, percentile
from sidecar.demo.workload import RequestRecord
from sidecar.headers import CONTENT_TYPE, X_CORRELATION_ID, X_DYNAMO_SESSION_ID, X_REQUEST_ID

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[[web.Application], Awaitable[Client]]

SYSTEM = "you are a careful assistant " * 6


def conversation(*user_turns: str, replies: list[list[str]] | None = None) -> list[dict[str, str]]:
    """System prompt + alternating user turns and the mock model's own replies."""
    messages = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(user_turns):
        messages.append({"role": "user", "content": text})
        if i < len(user_turns) - 1:
            reply = replies[i] if replies else reply_words(render_chat(messages))
            messages.append({"role": "assistant", "content": " ".join(reply)})
    return messages


async def chat(
    client: Client, messages: list[dict[str, str]], *, session: str | None = None, stream: bool = True
) -> tuple[str, dict[str, Any], list[bytes]]:
    """One chat request; returns (worker, usage, raw SSE events)."""
    headers = {X_REQUEST_ID: f"req-{id(messages)}"}
    if session is not None:
        headers[X_DYNAMO_SESSION_ID] = session
    body = {"model": "demo-model", "messages": messages, "stream": stream, "stream_options": {"include_usage": True}}
    async with client.post("/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        worker = resp.headers[X_WORKER_ID]
        if not stream:
            return worker, (await resp.json())["usage"], []
        events = [line.strip() async for line in resp.content if line.strip()]
    assert events[-1] == b"data: [DONE]"
    usage = orjson.loads(events[-2][len(b"data: ") :])["usage"]
    return worker, usage, events


@pytest.fixture
async def gateway(aiohttp_client: MakeClient) -> AsyncIterator[Client]:
    yield await aiohttp_client(create_gateway_app(MockGateway(n_workers=4)))


# ---------------------------------------------------------------- mock gateway: routing


async def test_session_header_pins_each_session_to_its_first_worker(gateway: Client) -> None:
    async def session(name: str) -> list[str]:
        workers = []
        for turn in range(4):
            w, _, _ = await chat(gateway, conversation(*[f"{name} turn {t}" for t in range(turn + 1)]), session=name)
            workers.append(w)
        return workers

    runs = await asyncio.gather(*(session(f"s{i}") for i in range(4)))
    assert all(len(set(ws)) == 1 for ws in runs), runs
    # The first requests of four concurrent sessions went to the least-loaded workers: all four.
    assert {ws[0] for ws in runs} == {"w0", "w1", "w2", "w3"}
    gw = gateway.app[GATEWAY_KEY]
    assert all(gw.pinned_worker(f"s{i}") == runs[i][0] for i in range(4))
    assert {r.session for r in gw.log} == {"s0", "s1", "s2", "s3"}


async def test_session_header_is_trimmed_and_empty_means_absent(gateway: Client) -> None:
    first, _, _ = await chat(gateway, conversation("hello"), session="  abc  ")
    again, _, _ = await chat(gateway, conversation("hello"), session="abc")
    assert first == again
    await chat(gateway, conversation("hello"), session="   ")
    assert [r.session for r in gateway.app[GATEWAY_KEY].log] == ["abc", "abc", None]


async def test_oversized_session_id_is_rejected(gateway: Client) -> None:
    body = {"messages": conversation("hi"), "stream": False}
    async with gateway.post("/v1/chat/completions", json=body, headers={X_DYNAMO_SESSION_ID: "x" * 257}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_without_header_requests_spread_over_workers(gateway: Client) -> None:
    # Sequential: every worker idle, so the round-robin tie-break visits each in turn.
    sequential = [(await chat(gateway, conversation("same prompt")))[0] for _ in range(8)]
    assert sequential == ["w0", "w1", "w2", "w3"] * 2
    # Concurrent: least-loaded puts four in-flight requests on four workers.
    concurrent = await asyncio.gather(*(chat(gateway, conversation(f"q{i}")) for i in range(4)))
    assert sorted(w for w, _, _ in concurrent) == ["w0", "w1", "w2", "w3"]


async def test_bad_bodies_get_openai_errors(gateway: Client) -> None:
    for payload in (b"not json", b"[1, 2]", b'{"messages": []}', b'{"messages": [{"role": 1}]}'):
        async with gateway.post("/v1/chat/completions", data=payload) as resp:
            assert resp.status == 400
            assert "message" in (await resp.json())["error"]
    async with gateway.get("/v1/models") as resp:
        assert (await resp.json())["data"][0]["id"] == "demo-model"
    async with gateway.get("/health") as resp:
        assert resp.status == 200


# ---------------------------------------------------------------- mock gateway: prefix cache


def test_prefix_cache_counts_leading_full_blocks() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=100)
    tokens = [f"t{i}" for i in range(10)]
    assert cache.match(tokens) == 0
    cache.insert(tokens)  # two full blocks held; the partial third is not
    assert len(cache) == 2
    assert cache.match(tokens + ["more"] * 7) == 8
    assert cache.match(tokens[:8] + ["x"]) == 8
    assert cache.match(tokens[:8]) == 4  # the last token is always computed
    assert cache.match(["other"] + tokens) == 0  # block hashes cover the whole prefix
    assert cache.match(tokens[:4] + ["changed"] + tokens[5:]) == 4


def test_prefix_cache_is_bounded_lru() -> None:
    cache = PrefixCache(block_size=2, capacity_blocks=3)
    a = ["a1", "a2", "a3", "a4"]
    b = ["b1", "b2", "b3", "b4"]
    cache.insert(a)
    cache.insert(b)  # 4 blocks > 3: a's first block is evicted, so a no longer matches
    assert len(cache) == 3
    assert cache.match(a + ["x"]) == 0
    assert cache.match(b + ["x"]) == 4


async def test_extended_prompt_hits_on_same_worker_and_not_on_a_cold_one(gateway: Client) -> None:
    turn1 = conversation("first question about the cache")
    w1, usage1, events = await chat(gateway, turn1, session="warm")
    assert usage1["prompt_tokens"] == len(render_chat(turn1))
    assert usage1["prompt_tokens_details"]["cached_tokens"] == 0
    # Streamed: a role chunk, several content chunks, a finish chunk, usage, [DONE].
    assert len(events) >= 5 and all(e.startswith(b"data: ") for e in events)

    turn2 = conversation("first question about the cache", "and a follow up question")
    tokens1 = render_chat(turn1) + reply_words(render_chat(turn1))
    tokens2 = render_chat(turn2)
    assert tokens2[: len(tokens1)] == tokens1  # the next turn's prompt extends prompt + reply
    expected = min(len(tokens1) // BLOCK_SIZE, (len(tokens2) - 1) // BLOCK_SIZE) * BLOCK_SIZE
    assert expected > 0

    w2, usage2, _ = await chat(gateway, turn2, session="warm")
    assert w2 == w1
    assert usage2["prompt_tokens"] == len(tokens2)
    assert usage2["prompt_tokens_details"]["cached_tokens"] == expected

    w3, usage3, _ = await chat(gateway, turn2, session="cold", stream=False)
    assert w3 != w1  # a new session goes to the next idle worker, which never saw this prompt
    assert usage3["prompt_tokens_details"]["cached_tokens"] == 0


# ---------------------------------------------------------------- report


def _rec(session: int, turn: int, worker: str | None, ok: bool = True) -> RequestRecord:
    return RequestRecord(session, turn, worker, 100, 50 if ok else 0, 0.01 * (turn + 1), ok, None if ok else "boom")


def test_switches_count_worker_changes_within_sessions() -> None:
    records = [
        _rec(0, 0, "w0"),
        _rec(0, 1, "w1"),
        _rec(0, 2, "w1"),
        _rec(1, 2, "w0"),
        _rec(1, 0, "w2"),
        _rec(1, 1, "w2"),
        _rec(2, 0, "w3"),
        _rec(2, 1, None, ok=False),
    ]
    assert count_switches(records) == 2


def test_percentile_and_table_alignment() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0
    assert percentile([1.0], 99) == 1.0
    direct = RunMetrics(80, 0, 31, 14000, 6000, 0.43, 20.0, 30.0, 0.2)
    via = RunMetrics(80, 0, 0, 14000, 10500, 0.75, 21.5, 32.0, 0.2)
    table = format_table(direct, via, AddedLatency(1.5, 1.2, 1.8, 400), title="t")
    lines = table.splitlines()
    assert lines[0] == "t"
    assert "direct" in lines[1] and "via sidecar" in lines[1]
    assert len({len(line) for line in lines[1:-1] if not line.endswith("-")}) == 1
    assert any("+1.5" in line for line in lines)


def test_added_latency_below_its_noise_is_never_a_negative_figure() -> None:
    """A sidecar that measured "faster" than no sidecar (the two medians 0.02 ms apart, noise) is
    reported as within measurement noise, bounded by the interval's top."""
    direct = [0.20 + 0.01 * (i % 7) for i in range(400)]
    via = [d + (-0.05 if i % 2 else 0.03) for i, d in enumerate(direct)]
    added = added_latency(direct, via)
    assert added.median_ms < 0 and not added.measurable
    row = format_table(
        RunMetrics(1, 0, 0, 1, 1, 1.0, 1.0, 1.0, 0.1), RunMetrics(1, 0, 0, 1, 1, 1.0, 1.0, 1.0, 0.1), added
    )
    assert re.search(r"\nsidecar added latency \(ms\) +- +< 0\.03\n", row), row
    assert row.splitlines()[-1].startswith("sidecar added latency: within measurement noise (at most 0.03 ms")
    assert not re.search(r"added latency.*-\d", row)
    clear = added_latency(direct, [d + 0.08 + 0.001 * (i % 5) for i, d in enumerate(direct)])
    assert clear.measurable and clear.cell() == "+0.08"


# ---------------------------------------------------------------- full demo

# 6 sessions on 4 workers: some workers must carry two sessions, so without affinity the
# least-loaded choice moves sessions on every run (with 4 sessions on 4 workers each session
# usually finds its own just-freed worker least loaded and stays by accident).
SESSIONS, TURNS = 6, 3


def _check_demo(result: DemoResult, printed: str) -> None:
    n = SESSIONS * TURNS
    assert (result.direct.requests, result.via_sidecar.requests) == (n, n)
    assert result.direct.errors == result.via_sidecar.errors == 0
    assert result.via_sidecar.switches == 0
    assert result.direct.switches > 0
    assert result.ok
    assert result.via_sidecar.cached_ratio > result.direct.cached_ratio
    # Same conversations both times.
    assert result.direct.prompt_tokens == result.via_sidecar.prompt_tokens
    assert printed == result.table
    header = result.table.splitlines()[1]
    assert "direct" in header and "via sidecar" in header
    assert "worker switches" in result.table and "cached ratio" in result.table


async def test_demo_through_the_real_sidecar() -> None:
    out = io.StringIO()
    result = await run_demo(sessions=SESSIONS, turns=TURNS, out=out)
    _check_demo(result, out.getvalue())


class HeaderCopyProxy:
    """Minimal stand-in sidecar: copies X-Correlation-ID into X-Dynamo-Session-ID."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.proxy_url: str | None = None
        self.seen_sessions: set[str] = set()
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._http is not None
        headers = {
            X_REQUEST_ID: request.headers.get(X_REQUEST_ID, ""),
            CONTENT_TYPE: request.headers.get(CONTENT_TYPE, "application/json"),
        }
        if X_CORRELATION_ID in request.headers:
            headers[X_DYNAMO_SESSION_ID] = request.headers[X_CORRELATION_ID]
            self.seen_sessions.add(request.headers[X_CORRELATION_ID])
        async with self._http.post(self.upstream + request.path, data=await request.read(), headers=headers) as up:
            resp = web.StreamResponse(
                status=up.status,
                headers={X_WORKER_ID: up.headers.get(X_WORKER_ID, ""), CONTENT_TYPE: up.headers.get(CONTENT_TYPE, "")},
            )
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def start(self) -> None:
        self._http = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.proxy_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()


async def test_demo_with_an_injected_sidecar() -> None:
    proxies: list[HeaderCopyProxy] = []

    def factory(upstream: str) -> HeaderCopyProxy:
        proxies.append(HeaderCopyProxy(upstream))
        return proxies[-1]

    out = io.StringIO()
    result = await run_demo(sessions=SESSIONS, turns=TURNS, out=out, sidecar_factory=factory)
    _check_demo(result, out.getvalue())
    assert len(proxies) == 1 and len(proxies[0].seen_sessions) == SESSIONS
    # a stand-in without an admin listener is not asked for its own accounting
    assert result.sidecar_accounting is None
    assert re.search(r"\n  the sidecar's own count +- +-\n", result.table), result.table


async def test_the_sidecars_own_count_agrees_with_the_workloads() -> None:
    """Every streamed answer of the demo's gateway reports its usage; the sidecar counts the same
    prompt and cached tokens as the workload read from them, and no response without usage."""
    out = io.StringIO()
    result = await run_demo(sessions=SESSIONS, turns=TURNS, out=out)
    via, counted = result.via_sidecar, result.sidecar_accounting
    assert counted is not None
    assert (counted.prompt_tokens, counted.cached_tokens) == (via.prompt_tokens, via.cached_tokens)
    assert (counted.reported, counted.unknown) == (SESSIONS * TURNS, 0)
    assert counted.agrees_with(via)
    cell = f"{via.cached_tokens}/{via.prompt_tokens}"
    assert re.search(rf"\n  the sidecar's own count +- +{cell}\n", result.table), result.table
    assert f"the sidecar's own count agrees with the workload's: {SESSIONS * TURNS} responses reported" in result.table


# ---------------------------------------------------------------- the command


def test_demo_command_reports_a_readable_added_latency() -> None:
    """The added latency printed is a figure above its noise floor with its interval, or "within
    measurement noise" with the most it can be: never a bare signed difference of two medians."""
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "demo", "--sessions", str(SESSIONS), "--turns", str(TURNS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("sidecar added latency (ms)")]
    (note,) = [line for line in out.stdout.splitlines() if line.startswith("sidecar added latency:")]
    figure = row.split()[-1]
    if row.split()[-2] == "<":  # within noise: the most it can be
        assert re.fullmatch(r"\d+\.\d\d", figure) and note.startswith(
            f"sidecar added latency: within measurement noise (at most {figure} ms: the 95% confidence interval of "
            "the median of 400 paired sequential requests reaches 0)"
        ), (row, note)
    else:
        assert re.fullmatch(r"\+\d+\.\d\d", figure), row
        m = re.fullmatch(
            r"sidecar added latency: median of 400 paired sequential requests, 95% confidence "
            r"\+(\d+\.\d{3}) to \+(\d+\.\d{3}) ms",
            note,
        )
        assert m is not None, note
        low, high = m.groups()
        assert float(low) - 0.005 <= float(figure) <= float(high) + 0.005  # the figure has two decimals


def test_demo_help_describes_each_option() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "demo", "--help"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0
    assert re.search(r"--sessions N +concurrent conversations \(default 16\)", out.stdout), out.stdout
    assert re.search(r"--turns N +streamed turns per conversation \(default 5\)", out.stdout), out.stdout
    assert "mock gateway" in out.stdout and "Exit 0 when" in " ".join(out.stdout.split())
