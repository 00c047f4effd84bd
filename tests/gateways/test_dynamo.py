"""NVIDIA Dynamo 1.6.1 (frontend ``--router-mode kv --router-session-affinity-ttl-secs 60`` and
two mocker engines), through the sidecar's ``dynamo_headers`` mode and directly.

Which worker served is ``nvext.worker_id.decode_worker_id`` in every response / streamed chunk
(requested with ``"nvext": {"extra_fields": ["worker_id"]}``).
"""

from __future__ import annotations

import uuid

import aiohttp
import pytest

from .procs import (
    DYNAMO_WORKER_ID_BODY,
    MODEL,
    Sidecar,
    Stack,
    dynamo_worker,
    failed_turns,
    new_session_ids,
    run_sessions,
    summarize,
)

pytestmark = [pytest.mark.gateway, pytest.mark.timeout(120)]

SESSIONS, TURNS, CONCURRENCY = 8, 4, 4
DYNAMO_MAX_SESSION_ID_BYTES = 256


@pytest.fixture(scope="module")
def dynamo_sidecar(dynamo: Stack, sidecar_factory) -> Sidecar:
    return sidecar_factory(dynamo.url, "dynamo_headers")


def assert_zero_switches(results) -> None:
    assert not failed_turns(results), failed_turns(results)
    for sid, r in results.items():
        assert None not in r.workers, f"{sid}: a response lacks nvext.worker_id"
        assert r.switches == 0, f"session {sid} switched workers: {r.workers}"


async def post_chat(url: str, headers: dict[str, str], body_extra: dict | None = None):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}], **(body_extra or {})}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            return resp.status, await resp.text()


async def test_direct_session_header_zero_switches(dynamo: Stack) -> None:
    """Gateway sanity: Dynamo itself honours X-Dynamo-Session-ID."""
    results = await run_sessions(
        dynamo.url,
        new_session_ids(SESSIONS),
        turns=TURNS,
        concurrency=CONCURRENCY,
        worker_of=dynamo_worker,
        body_extra=DYNAMO_WORKER_ID_BODY,
        session_headers=lambda sid, turn, last: {"X-Correlation-ID": sid, "X-Dynamo-Session-ID": sid},
    )
    assert_zero_switches(results)


async def test_direct_without_session_header_control(dynamo: Stack, gateway_report) -> None:
    """Control: the workload straight to Dynamo with only X-Correlation-ID. Reported only."""
    results = await run_sessions(
        dynamo.url,
        new_session_ids(SESSIONS),
        turns=TURNS,
        concurrency=CONCURRENCY,
        worker_of=dynamo_worker,
        body_extra=DYNAMO_WORKER_ID_BODY,
    )
    assert not failed_turns(results), failed_turns(results)
    s = summarize(results)
    gateway_report(
        f"Dynamo kv router without sidecar: {s['moved']}/{s['sessions']} sessions "
        f"moved, {s['switches']} worker switches in {SESSIONS * TURNS} requests"
    )


async def test_direct_session_id_over_256_bytes_is_rejected(dynamo: Stack) -> None:
    """Why the sidecar must map long ids: Dynamo answers 400 to X-Dynamo-Session-ID > 256 B."""
    status, text = await post_chat(dynamo.url, {"X-Dynamo-Session-ID": "s" * 300})
    assert status == 400, text


async def test_direct_nvext_session_control_is_rejected(dynamo: Stack) -> None:
    """Why dynamo_nvext is not for this build: from 1.3.0 nvext has no session_control."""
    control = {"session_id": str(uuid.uuid4()), "action": "open", "timeout": 30}
    status, text = await post_chat(dynamo.url, {}, {"nvext": {"session_control": control}})
    assert status == 400 and "session_control" in text, text


async def test_sidecar_sessions_have_zero_worker_switches(
    dynamo: Stack, dynamo_sidecar: Sidecar, gateway_report
) -> None:
    results = await run_sessions(
        dynamo_sidecar.url,
        new_session_ids(SESSIONS),
        turns=TURNS,
        concurrency=CONCURRENCY,
        worker_of=dynamo_worker,
        body_extra=DYNAMO_WORKER_ID_BODY,
    )
    assert_zero_switches(results)
    s = summarize(results)
    gateway_report(f"Dynamo through sidecar: {s['switches']} worker switches, {s['workers_used']} workers used")


async def test_sidecar_300_byte_session_id_stays_on_one_worker(dynamo: Stack, dynamo_sidecar: Sidecar) -> None:
    sid = f"agent-run/{uuid.uuid4()}/".ljust(300, "x")
    assert len(sid.encode()) > DYNAMO_MAX_SESSION_ID_BYTES
    results = await run_sessions(
        dynamo_sidecar.url, [sid], turns=6, worker_of=dynamo_worker, body_extra=DYNAMO_WORKER_ID_BODY
    )
    assert_zero_switches(results)
