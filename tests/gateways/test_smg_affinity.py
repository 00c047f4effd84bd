"""Affinity proof against real SMG 1.13 (``--policy manual``) with three mock workers, through
the sidecar's ``smg_routing_key`` mode (issue acceptance: "100% same_worker after each
session's first turn, and killing a worker shows moved for exactly the sessions that lived on
it").

This module starts its OWN mock workers, SMG and sidecar (it SIGKILLs a worker, so it must not
share processes with other modules). SMG probes worker health every second and marks a worker
unhealthy after one failed probe. The sidecar runs at debug level so its ``"event": "moved"`` log
lines carry the session id.

What the sidecar records is read back three ways: ``sidecar_affinity_turns_total{outcome}`` on
the admin ``/metrics``, each session's worker runs and ``affinity`` counts from the admin API
(``GET /v1/trees/{root}``: each session here is its own root; ``GET /v1/sessions/{id}`` does not
carry the worker history), and the ``moved`` log lines. Ground truth for who served each turn is
SMG's ``x-smg-routed-worker-id`` response header as the client saw it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import require_gateway
from .procs import (
    ManagedProcess,
    MockWorker,
    Sidecar,
    Stack,
    failed_turns,
    http_get,
    new_session_ids,
    run_sessions,
    start_mock_workers,
    start_sidecar,
    start_smg,
    stop_all,
    worker_from_header,
)

pytestmark = [pytest.mark.gateway, pytest.mark.timeout(120)]

ROUTED_WORKER = "x-smg-routed-worker-id"
SESSIONS, TURNS, CONCURRENCY = 12, 4, 4
# Fast failure detection: probe every second, unhealthy after one failed probe.
SMG_HEALTH_ARGS = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1")
DETECTION_TIMEOUT = 15.0  # seconds SMG gets to mark the killed worker unhealthy

served_by = worker_from_header(ROUTED_WORKER)
_AFFINITY_SAMPLE = re.compile(
    r'^sidecar_affinity_turns_total\{deployment="[^"]*",outcome="(first|same_worker|moved)"\} ([0-9.e+]+)$', re.M
)


@pytest.fixture
def affinity_stack(gateway_logs: Path) -> Iterator[tuple[list[MockWorker], Stack, Sidecar]]:
    """Three mock workers, SMG ``--policy manual`` with fast health checks, and the sidecar
    (``smg_routing_key``, ``--log-level debug``) in front; all stopped by PID afterwards."""
    require_gateway("smg")
    procs: list[ManagedProcess] = []
    try:
        workers = start_mock_workers(["w1", "w2", "w3"], gateway_logs)
        procs += [w.proc for w in workers]
        smg = start_smg([w.url for w in workers], gateway_logs, policy="manual", extra_args=SMG_HEALTH_ARGS)
        procs += smg.procs
        sidecar = start_sidecar(smg.url, "smg_routing_key", gateway_logs, extra_args=["--log-level", "debug"])
        procs.append(sidecar.proc)
        yield workers, smg, sidecar
    finally:
        stop_all(procs)


def affinity_counts(sidecar: Sidecar) -> dict[str, int]:
    found = {k: int(float(v)) for k, v in _AFFINITY_SAMPLE.findall(sidecar.metrics_text())}
    return {k: found.get(k, 0) for k in ("first", "same_worker", "moved")}


def history(sidecar: Sidecar, sid: str) -> dict[str, Any]:
    """The session's node from the admin API: ``turns``, ``workers`` runs, ``affinity``."""
    got = http_get(f"{sidecar.admin_url}/v1/sessions/{sid}")
    assert got is not None and got[0] == 200, f"GET /v1/sessions/{sid}: {got}"
    node = json.loads(got[1])
    assert node["id"] == sid
    return node


def moved_log_lines(sidecar: Sidecar) -> list[dict[str, Any]]:
    """The sidecar's ``"event": "moved"`` JSON log lines (its stderr, in its log file)."""
    lines = []
    for raw in sidecar.proc.output().splitlines():
        if not raw.startswith("{"):
            continue
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if entry.get("event") == "moved":
            lines.append(entry)
    return lines


def smg_healthy_workers(smg: Stack) -> set[str]:
    got = http_get(f"{smg.url}/workers")
    assert got is not None and got[0] == 200, f"SMG GET /workers: {got}"
    return {
        w["url"] for w in json.loads(got[1]).get("workers", []) if w.get("is_healthy") and w.get("status") == "ready"
    }


async def test_manual_policy_same_worker_then_moved_exactly_for_killed_workers_sessions(
    affinity_stack: tuple[list[MockWorker], Stack, Sidecar], gateway_report
) -> None:
    workers, smg, sidecar = affinity_stack
    started = time.monotonic()
    sids = new_session_ids(SESSIONS)

    # -- 1. Multi-turn workload: every turn after a session's first stays on its worker. -------
    results = await run_sessions(sidecar.url, sids, turns=TURNS, concurrency=CONCURRENCY, worker_of=served_by)
    assert not failed_turns(results), failed_turns(results)
    home: dict[str, str] = {}
    for sid, r in results.items():
        assert None not in r.workers, f"{sid}: a response lacks {ROUTED_WORKER}: {r.workers}"
        assert len(set(r.workers)) == 1, f"{sid} moved between workers: {r.workers}"
        home[sid] = r.workers[0]  # type: ignore[assignment]

    assert affinity_counts(sidecar) == {"first": SESSIONS, "same_worker": SESSIONS * (TURNS - 1), "moved": 0}
    for sid in sids:
        node = history(sidecar, sid)
        assert node["turns"] == TURNS
        assert node["workers"] == [{"worker": home[sid], "turns": TURNS}], sid
        assert node["affinity"] == {"first": 1, "same_worker": TURNS - 1, "moved": 0}, sid
    assert moved_log_lines(sidecar) == []

    # -- 2. Kill the worker holding the most sessions; SMG must notice. -----------------------
    by_worker = Counter(home.values())
    victim_url, _ = by_worker.most_common(1)[0]
    victim = next(w for w in workers if w.url == victim_url)
    on_victim = {sid for sid, w in home.items() if w == victim_url}
    survivors = set(sids) - on_victim
    assert on_victim and survivors, f"sessions all on one worker: {dict(by_worker)}"

    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.popen.wait(timeout=10)
    killed_at = time.monotonic()
    deadline = killed_at + DETECTION_TIMEOUT
    while victim_url in smg_healthy_workers(smg):
        assert time.monotonic() < deadline, (
            f"SMG still lists {victim_url} healthy {DETECTION_TIMEOUT:.0f} s after SIGKILL"
        )
        await asyncio.sleep(0.05)
    detected_after = time.monotonic() - killed_at
    assert smg_healthy_workers(smg) == {w.url for w in workers} - {victim_url}

    # -- 3. One more turn per session: exactly the killed worker's sessions move. -------------
    # Observed with SMG 1.13: once the worker is marked unhealthy, a pinned key whose worker is
    # gone is reassigned on the spot and the request succeeds; no turn fails, so none is retried.
    after = await run_sessions(sidecar.url, sids, turns=1, concurrency=CONCURRENCY, worker_of=served_by)
    assert not failed_turns(after), failed_turns(after)
    new_home = {sid: r.workers[0] for sid, r in after.items()}
    assert None not in new_home.values(), new_home

    moved_now = {sid for sid in sids if new_home[sid] != home[sid]}
    assert moved_now == on_victim, "the sessions served elsewhere are exactly the victim's"
    assert victim_url not in new_home.values()
    assert affinity_counts(sidecar) == {
        "first": SESSIONS,
        "same_worker": SESSIONS * (TURNS - 1) + len(survivors),
        "moved": len(on_victim),
    }
    for sid in on_victim:
        node = history(sidecar, sid)
        assert node["workers"] == [{"worker": victim_url, "turns": TURNS}, {"worker": new_home[sid], "turns": 1}], sid
        assert node["affinity"] == {"first": 1, "same_worker": TURNS - 1, "moved": 1}, sid
    for sid in survivors:
        node = history(sidecar, sid)
        assert node["workers"] == [{"worker": home[sid], "turns": TURNS + 1}], sid
        assert node["affinity"] == {"first": 1, "same_worker": TURNS, "moved": 0}, sid

    logged = moved_log_lines(sidecar)
    assert len(logged) == len(on_victim), logged
    assert {e["session"] for e in logged} == on_victim
    for e in logged:
        assert e["from_worker"] == victim_url, e
        assert e["to_worker"] == new_home[e["session"]], e
        assert e["turn"] == TURNS + 1, e
        assert e["level"] == "info" and e["deployment"] == "default", e

    # -- 4. SMG re-pinned the moved keys: the next turn stays on the new worker. --------------
    again = await run_sessions(sidecar.url, sids, turns=1, concurrency=CONCURRENCY, worker_of=served_by)
    assert not failed_turns(again), failed_turns(again)
    assert {sid: r.workers[0] for sid, r in again.items()} == new_home
    assert affinity_counts(sidecar) == {
        "first": SESSIONS,
        "same_worker": SESSIONS * (TURNS - 1) + len(survivors) + SESSIONS,
        "moved": len(on_victim),
    }
    assert len(moved_log_lines(sidecar)) == len(on_victim)

    elapsed = time.monotonic() - started
    gateway_report(
        f"SMG --policy manual + sidecar, {SESSIONS}x{TURNS} turns: 100% same_worker; killed "
        f"{victim.name} ({len(on_victim)} sessions, split {sorted(by_worker.values())}), SMG "
        f"marked it unhealthy after {detected_after:.2f} s, next turn: 0 failed, "
        f"{len(on_victim)} moved, {len(survivors)} same_worker; {elapsed:.1f} s"
    )
