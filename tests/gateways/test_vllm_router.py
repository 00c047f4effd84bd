"""vllm-router 0.1.17 (``--policy sticky_least_loaded``) with two mock workers, through the
sidecar's ``vllm_router`` mode and directly.

vllm-router names no worker in its responses, so the mock workers' ``X-Mock-Worker`` header is
the ground truth. Its log line ``SLL: finished session '<id>'`` shows that a
``POST /finish_session?session_id=<id>`` released a session it knew.
"""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .procs import (
    MockWorker,
    Sidecar,
    Stack,
    failed_turns,
    new_session_ids,
    run_sessions,
    summarize,
    worker_from_header,
)

pytestmark = [pytest.mark.gateway, pytest.mark.timeout(120)]

SESSIONS, TURNS, CONCURRENCY = 8, 4, 4
END_ACTIONS = "sidecar_end_actions_total"
END_ACTION_OK = {"mode": "vllm_router", "outcome": "ok"}

served_by = worker_from_header("x-mock-worker")


@pytest.fixture(scope="module")
def vllm_sidecar(vllm_router: Stack, sidecar_factory) -> Sidecar:
    return sidecar_factory(vllm_router.url, "vllm_router")


def assert_sticky(results) -> None:
    assert not failed_turns(results), failed_turns(results)
    for sid, r in results.items():
        assert None not in r.workers, f"{sid}: a response lacks X-Mock-Worker"
        assert len(set(r.workers)) == 1, f"session {sid} moved between workers: {r.workers}"


def finished_sessions(router: Stack) -> list[str]:
    """Session ids vllm-router logged as finished (sessions it knew), in order."""
    return re.findall(r"SLL: finished session '([^']*)'", router.proc("vllm-router").output())


def end_actions_ok(sidecar: Sidecar) -> float:
    for family in text_string_to_metric_families(sidecar.metrics_text()):
        for sample in family.samples:
            if sample.name == END_ACTIONS and all(sample.labels.get(k) == v for k, v in END_ACTION_OK.items()):
                return sample.value
    return 0.0


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


async def test_direct_session_header_and_finish_session(vllm_router: Stack, fresh_workers: list[MockWorker]) -> None:
    """Gateway sanity: x-session-id pins sessions; /finish_session releases them."""
    results = await run_sessions(
        vllm_router.url,
        new_session_ids(SESSIONS),
        turns=TURNS,
        concurrency=CONCURRENCY,
        worker_of=served_by,
        session_headers=lambda sid, turn, last: {"X-Correlation-ID": sid, "X-Session-ID": sid},
    )
    assert_sticky(results)
    async with aiohttp.ClientSession() as http:
        for sid in results:
            async with http.post(f"{vllm_router.url}/finish_session", params={"session_id": sid}) as resp:
                assert resp.status == 200
                assert (await resp.json())["status"] == "ok"
    assert wait_for(lambda: set(results) <= set(finished_sessions(vllm_router)))


async def test_direct_control(vllm_router: Stack, fresh_workers: list[MockWorker], gateway_report) -> None:
    """Control: straight to vllm-router, AIPerf-style headers only (X-Correlation-ID, a fresh
    X-Request-ID per request), then with X-Request-ID alone. Reported only."""
    runs = {
        "X-Correlation-ID + X-Request-ID": None,
        "X-Request-ID only": lambda sid, turn, last: {},
    }
    for label, headers in runs.items():
        results = await run_sessions(
            vllm_router.url,
            new_session_ids(SESSIONS),
            turns=TURNS,
            concurrency=CONCURRENCY,
            worker_of=served_by,
            session_headers=headers,
        )
        assert not failed_turns(results), failed_turns(results)
        s = summarize(results)
        gateway_report(
            f"vllm-router sticky_least_loaded without sidecar, {label}: "
            f"{s['moved']}/{s['sessions']} sessions moved, {s['switches']} switches"
        )


async def test_sidecar_sticky_sessions_and_finish_session(
    vllm_router: Stack, vllm_sidecar: Sidecar, fresh_workers: list[MockWorker]
) -> None:
    """Each session stays on one worker; its final turn (X-Session-Final: true) makes the
    sidecar call POST /finish_session?session_id=<id>, once per session."""
    before = end_actions_ok(vllm_sidecar)
    results = await run_sessions(
        vllm_sidecar.url,
        new_session_ids(SESSIONS),
        turns=TURNS,
        concurrency=CONCURRENCY,
        worker_of=served_by,
        session_headers=lambda sid, turn, last: {
            "X-Correlation-ID": sid,
            **({"X-Session-Final": "true"} if last else {}),
        },
    )
    assert_sticky(results)
    # End-of-session actions run after the last byte is proxied: poll, bounded.
    assert wait_for(lambda: end_actions_ok(vllm_sidecar) >= before + SESSIONS), (
        f"{END_ACTIONS}{END_ACTION_OK}: {before} -> {end_actions_ok(vllm_sidecar)}, expected +{SESSIONS}"
    )
    await asyncio.sleep(0.5)  # a duplicate end action would show up here
    assert end_actions_ok(vllm_sidecar) == before + SESSIONS
    # The router itself released each session it had pinned.
    finished = finished_sessions(vllm_router)
    assert set(results) <= set(finished), set(results) - set(finished)
    assert all(finished.count(sid) == 1 for sid in results)
