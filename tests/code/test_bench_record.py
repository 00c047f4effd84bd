"""bench/record.py's wake probe: a real echo process on another core, measured and stopped."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import record  # noqa: E402

TWO_CORES = pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs cores 0 and 1")


@TWO_CORES
def test_wake_round_trip_measures_and_stops_its_peer() -> None:
    own = os.sched_getaffinity(0)
    before = set(_children())  # (other tests' servers may be running)
    wake = record.wake_round_trip(0, 1, samples=50, idle_s=0.001)
    assert wake["samples"] == 50
    assert 0 < wake["p50_us"] <= wake["p99_us"] <= wake["max_us"]
    assert os.sched_getaffinity(0) == own  # the measurement's pinning is undone
    assert set(_children()) <= before  # the echo process ended and was reaped


def _children() -> list[str]:
    """This process's child processes, zombies included."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == os.getpid():
            found.append(pid)
    return found


@TWO_CORES
def test_facts_table_names_the_wake_time() -> None:
    facts = record.machine_facts(wake_cores=(0, 1))
    line = record.fact_lines(facts)[-1]
    assert line.startswith("| waking a sleeping process, core 0 to 1 and back | p50 ")
    assert facts["wake_round_trip"]["cores"] == [0, 1]


def test_sidecar_build_is_read_not_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    """The facts say how the sidecar ran: its probe imports what the installed package has."""
    assert record.sidecar_build() in {"compiled", "pure Python"}
    monkeypatch.setenv("SIDECAR_PURE_PYTHON", "1")
    assert record.sidecar_build() == "pure Python"
