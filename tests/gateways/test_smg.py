"""SMG 1.13 (``--policy manual``) with two mock workers, through the sidecar's
``smg_routing_key`` mode and directly.

Ground truth for "who served" is SMG's ``x-smg-routed-worker-id`` response header; what reached
the workers is read back from the mock workers (SMG forwards ``x-smg-routing-key`` and
``x-correlation-id`` to them).
"""

from __future__ import annotations

import uuid

import pytest

from .procs import (
    MockWorker,
    Sidecar,
    Stack,
    failed_turns,
    header_values_by_session,
    new_session_ids,
    run_sessions,
    summarize,
    worker_from_header,
)

pytestmark = [pytest.mark.gateway, pytest.mark.timeout(120)]

ROUTED_WORKER = "x-smg-routed-worker-id"
ROUTING_KEY = "x-smg-routing-key"
SMG_MAX_KEY_BYTES = 128
SESSIONS, TURNS, CONCURRENCY = 8, 4, 4

served_by = worker_from_header(ROUTED_WORKER)


@pytest.fixture(scope="module")
def smg_sidecar(smg: Stack, sidecar_factory) -> Sidecar:
    return sidecar_factory(smg.url, "smg_routing_key")


def assert_sticky(results) -> None:
    assert not failed_turns(results), failed_turns(results)
    for sid, r in results.items():
        assert None not in r.workers, f"{sid}: a response lacks {ROUTED_WORKER}"
        assert len(set(r.workers)) == 1, f"session {sid} moved between workers: {r.workers}"


async def test_direct_routing_key_pins_each_session(smg: Stack, fresh_workers: list[MockWorker]) -> None:
    """Gateway sanity: SMG itself honours X-SMG-Routing-Key under --policy manual."""
    results = await run_sessions(
        smg.url,
        new_session_ids(SESSIONS),
        turns=TURNS,
        concurrency=CONCURRENCY,
        worker_of=served_by,
        session_headers=lambda sid, turn, last: {"X-Correlation-ID": sid, "X-SMG-Routing-Key": sid},
    )
    assert_sticky(results)
    keys = header_values_by_session(fresh_workers, ROUTING_KEY)
    assert keys == {sid: {sid} for sid in results}


async def test_direct_without_routing_key_control(smg: Stack, fresh_workers: list[MockWorker], gateway_report) -> None:
    """Control: the same workload straight to SMG with only X-Correlation-ID (what AIPerf sends).
    Reports how many sessions moved; asserts only that every request succeeded."""
    results = await run_sessions(
        smg.url, new_session_ids(SESSIONS), turns=TURNS, concurrency=CONCURRENCY, worker_of=served_by
    )
    assert not failed_turns(results), failed_turns(results)
    s = summarize(results)
    gateway_report(
        f"SMG --policy manual without sidecar: {s['moved']}/{s['sessions']} sessions "
        f"moved, {s['switches']} worker switches in {SESSIONS * TURNS} requests"
    )


async def test_sidecar_keeps_each_session_on_one_worker(
    smg: Stack, smg_sidecar: Sidecar, fresh_workers: list[MockWorker], gateway_report
) -> None:
    results = await run_sessions(
        smg_sidecar.url, new_session_ids(SESSIONS), turns=TURNS, concurrency=CONCURRENCY, worker_of=served_by
    )
    assert_sticky(results)
    keys = header_values_by_session(fresh_workers, ROUTING_KEY)
    assert set(keys) == set(results), "every session's turns reached a worker"
    for sid, values in keys.items():
        assert len(values) == 1 and None not in values, f"{sid}: routing keys {values}"
        (key,) = values
        assert 0 < len(key.encode()) <= SMG_MAX_KEY_BYTES
    assert len({next(iter(v)) for v in keys.values()}) == SESSIONS, "one key per session"
    s = summarize(results)
    gateway_report(
        f"SMG through sidecar: {s['moved']}/{s['sessions']} sessions moved, {s['workers_used']} workers used"
    )


async def test_sidecar_session_id_longer_than_128_bytes_stays_on_one_worker(
    smg: Stack, smg_sidecar: Sidecar, fresh_workers: list[MockWorker]
) -> None:
    """SMG silently ignores keys > 128 bytes (random routing); the sidecar must send a stable
    short key. 10 turns: random routing would keep them together with probability 1/512."""
    sid = f"agent-run/{uuid.uuid4()}/" + "x" * 200
    assert len(sid.encode()) > SMG_MAX_KEY_BYTES
    results = await run_sessions(smg_sidecar.url, [sid], turns=10, worker_of=served_by)
    assert_sticky(results)
    (values,) = header_values_by_session(fresh_workers, ROUTING_KEY).values()
    assert len(values) == 1 and None not in values, f"routing keys sent: {values}"
    (key,) = values
    assert 0 < len(key.encode()) <= SMG_MAX_KEY_BYTES
