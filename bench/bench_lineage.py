"""Memory and per-request cost of the session lineage tree. Run on demand, not in CI:

    python bench/bench_lineage.py [--sessions 1000000] [--small 1000] [--active 256]
        [--ops 200000] [--rounds 5] [--slices 10] [--out-dir bench/results]

Every run writes bench/results/<date>-bench_lineage-<commit>.md and .json (bench/record.py).

Population: 36-character UUID session ids in realistic trees (60% lone sessions, 30% a root with
1-3 children, 10% a root with 1-3 children that have 1-2 children each), each session with one
completed non-final turn, so that all of them are live and idle.

Memory: everything tracemalloc sees allocated for the populated tree, id strings included,
divided by the number of live sessions.

Cost: ns per request over ``--ops`` requests per round, median of ``--rounds`` rounds after one
warm-up round, at ``--small`` and at ``--sessions`` live sessions. Time is taken with
time.perf_counter_ns and, steadier on a shared machine, this process's CPU time. Each round runs
in ``--slices`` slices alternating between the two sizes, so that load from other processes
weighs on both alike, and each slice's requests are made just before it runs, as a server
parses a request's ids just before routing it (fresh string objects, no cached hash). 90% of
the requests are a non-final turn (begin + finish) of an existing session, 10% start a new
session (half roots, half children of an existing session). Three patterns:

- steady: the conversations in progress are the ``--active`` most recently started ones; new
  sessions join them and push the oldest out, older sessions sit idle, and the cap
  (``max_live`` = the size) evicts the least recently active. A sidecar's steady state.
- scattered: each round's turns go to ``--active`` sessions drawn at random from all live ones,
  and new sessions end with their one final turn. The same work as steady, with the objects
  touched spread over the whole heap: at the large size most accesses miss the CPU caches.
- cold: every turn picks a session uniformly among all live ones (new sessions as in
  scattered): the worst case for the caches.

Beside each pattern, the same lookups on a bare dict of the same ids: the part of a slowdown
that comes from the memory hierarchy, which no structure keyed by these ids avoids.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import record

from sidecar.context import TurnOutcome
from sidecar.lineage import SessionTree

DEPLOYMENT = "default"
COMPLETED = TurnOutcome.COMPLETED
PATTERNS = ("steady", "scattered", "cold")

Ids = list[tuple[str, str | None]]  # (session, parent)
Ops = list[tuple[str, str | None, bool]]  # (session, parent, final)


def new_id(rng: random.Random) -> str:
    h = f"{rng.getrandbits(128):032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def wire_copy(s: str | None) -> str | None:
    """An equal string that is a distinct object with no cached hash, like a parsed header."""
    return None if s is None else (s + " ")[:-1]


def one_turn(tree: SessionTree, session: str, parent: str | None) -> None:
    turn, _ = tree.begin(session, parent=parent, root_hint=None, final=False, deployment=DEPLOYMENT)
    tree.finish(turn, COMPLETED)


def populate(tree: SessionTree, n: int, rng: random.Random, keep: Ids | None) -> None:
    """Add realistic trees until ``n`` sessions were added; ``keep`` collects their ids in
    creation order."""
    added = 0
    while added < n:
        shape = rng.random()
        group: Ids = [(new_id(rng), None)]
        if shape >= 0.6:
            root = group[0][0]
            for _ in range(rng.randint(1, 3)):
                child = new_id(rng)
                group.append((child, root))
                if shape >= 0.9:
                    group.extend((new_id(rng), child) for _ in range(rng.randint(1, 2)))
        for session, parent in group[: n - added]:
            one_turn(tree, session, parent)
            if keep is not None:
                keep.append((session, parent))
        added += len(group)


def measure_memory(n: int, seed: int) -> tuple[int, float, float, float]:
    """(live sessions, bytes per live session, peak bytes per live session while building,
    ms of a full garbage collection with the tree alive)."""
    rng = random.Random(seed)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tree = SessionTree(max_live=n, idle_ttl=1e9)
    populate(tree, n, rng, None)
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    pause = time.perf_counter()
    gc.collect()
    pause = time.perf_counter() - pause
    live = tree.live_sessions
    assert live == n and tree.evictions == 0
    return live, (current - base) / live, (peak - base) / live, pause * 1e3


class Workload:
    """Makes the requests of one pattern against one tree."""

    def __init__(self, pattern: str, ids: Ids, active: int, rng: random.Random) -> None:
        self.pattern = pattern
        self.ids = ids
        self.active = active
        self.rng = rng
        self.pool = ids[-active:] if pattern == "steady" else ids

    def next_round(self) -> None:
        if self.pattern == "scattered":
            self.pool = self.rng.sample(self.ids, self.active)

    def make(self, count: int) -> Ops:
        rng, pool = self.rng, self.pool
        steady = self.pattern == "steady"
        ops: Ops = []
        for _ in range(count):
            r = rng.random()
            if r < 0.9:
                session, parent = pool[rng.randrange(len(pool))]
                ops.append((wire_copy(session), wire_copy(parent), False))  # type: ignore[arg-type]
                continue
            session = new_id(rng)
            parent = None if r < 0.95 else pool[rng.randrange(len(pool))][0]
            if steady:  # a new conversation: it stays live, joins the active ones, pushes one out
                pool.append((session, parent))
                del pool[0]
            ops.append((session, wire_copy(parent), not steady))
        return ops


def run_ops(tree: SessionTree, ops: Ops) -> tuple[int, int]:
    """(wall ns, CPU ns of this process) to run ``ops`` through ``tree``."""
    begin, finish = tree.begin, tree.finish
    cpu, wall = time.process_time_ns(), time.perf_counter_ns()
    for session, parent, final in ops:
        turn, _ = begin(session, parent=parent, root_hint=None, final=final, deployment=DEPLOYMENT)
        finish(turn, COMPLETED)
    return time.perf_counter_ns() - wall, time.process_time_ns() - cpu


def run_lookups(index: dict[str, None], ops: Ops) -> tuple[int, int]:
    get = index.get
    cpu, wall = time.process_time_ns(), time.perf_counter_ns()
    for session, _parent, _final in ops:
        get(session)
    return time.perf_counter_ns() - wall, time.process_time_ns() - cpu


class Series:
    """ns per request of each round, by wall clock and by this process's CPU time."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def add(self, wall: int, cpu: int, ops: int) -> None:
        self.wall.append(wall / ops)
        self.cpu.append(cpu / ops)


Setup = tuple[SessionTree, Ids, dict[str, None]]  # tree, its ids in creation order, bare dict


def build(n: int, capped: bool, seed: int) -> Setup:
    """``n`` live sessions; ``capped``: the cap is ``n`` (new sessions evict), else room for all."""
    tree = SessionTree(max_live=n if capped else 2 * n, idle_ttl=1e9)
    ids: Ids = []
    populate(tree, n, random.Random(seed), ids)
    return tree, ids, dict.fromkeys(s for s, _ in ids)


def measure_cost(
    pattern: str, setups: list[Setup], ops: int, rounds: int, slices: int, active: int, seed: int
) -> tuple[list[Series], list[Series]]:
    """Per setup: the tree's series and the bare dict's series for the same requests."""
    works = [Workload(pattern, ids, active, random.Random(seed + 1)) for _tree, ids, _index in setups]
    for (tree, _ids, _index), work in zip(setups, works):  # warm-up: fills the tombstones
        run_ops(tree, work.make(ops))
    trees = [Series() for _ in setups]
    dicts = [Series() for _ in setups]
    step = ops // slices
    for _ in range(rounds):
        for work in works:
            work.next_round()
        gc.collect()
        totals = [[0, 0, 0, 0] for _ in setups]
        for _ in range(slices):
            for (tree, _ids, index), work, total in zip(setups, works, totals):
                batch = work.make(step)
                wall, cpu = run_ops(tree, batch)
                total[0] += wall
                total[1] += cpu
                wall, cpu = run_lookups(index, batch)
                total[2] += wall
                total[3] += cpu
        for (tree, ids, _index), total, series, lookups in zip(setups, totals, trees, dicts):
            # steady: an evicted parent stays in its tree (ended) while its children live
            assert tree.live_sessions <= len(ids) if pattern == "steady" else tree.live_sessions == len(ids)
            series.add(total[0], total[1], step * slices)
            lookups.add(total[2], total[3], step * slices)
    return trees, dicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=1_000)
    parser.add_argument("--active", type=int, default=256)
    parser.add_argument("--ops", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--slices", type=int, default=10)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument(
        "--out-dir", type=Path, default=record.RESULTS, help="where the dated .md and .json go (default bench/results)"
    )
    args = parser.parse_args()
    facts = record.machine_facts()
    started = time.perf_counter()
    med = statistics.median
    lines: list[str] = []
    raw: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}

    def out(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    live, per_session, peak, pause = measure_memory(args.sessions, args.seed)
    raw["memory"] = {
        "live_sessions": live,
        "bytes_per_session": per_session,
        "peak_bytes_per_session": peak,
        "full_gc_ms": pause,
    }
    out(
        f"memory: {live} live sessions, {per_session:.0f} bytes/session "
        f"(peak while building {peak:.0f}), id strings included"
    )
    out(f"a full gc.collect() with them alive: {pause:.0f} ms")

    sizes = [args.small, args.sessions]
    uncapped: list[Setup] = []  # scattered and cold leave the population as they found it: shared
    raw["patterns"] = {}
    table = [
        "| pattern | live sessions | ns/request, wall | CPU | bare dict.get, wall | CPU |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    ratios = ["| pattern | cost ratio, wall | CPU |", "|---|---:|---:|"]
    for pattern in args.patterns.split(","):
        if pattern == "steady":
            setups = [build(n, True, args.seed) for n in sizes]
        else:
            setups = uncapped = uncapped or [build(n, False, args.seed) for n in sizes]
        trees, dicts = measure_cost(pattern, setups, args.ops, args.rounds, args.slices, args.active, args.seed)
        del setups
        raw["patterns"][pattern] = {
            str(n): {
                "tree_wall_ns": series.wall,
                "tree_cpu_ns": series.cpu,
                "dict_wall_ns": lookups.wall,
                "dict_cpu_ns": lookups.cpu,
            }
            for n, series, lookups in zip(sizes, trees, dicts)
        }
        for n, series, lookups in zip(sizes, trees, dicts):
            out(
                f"{pattern}: {n} live: {med(series.wall):.0f} ns/request wall "
                f"(rounds {', '.join(f'{r:.0f}' for r in series.wall)}), {med(series.cpu):.0f} CPU; "
                f"bare dict.get {med(lookups.wall):.0f} wall, {med(lookups.cpu):.0f} CPU"
            )
            table.append(
                f"| {pattern} | {n:,} | {med(series.wall):.0f} | {med(series.cpu):.0f} | "
                f"{med(lookups.wall):.0f} | {med(lookups.cpu):.0f} |"
            )
        small, large = trees
        wall_ratio, cpu_ratio = med(large.wall) / med(small.wall), med(large.cpu) / med(small.cpu)
        out(f"{pattern}: cost ratio {args.sessions} / {args.small}: {wall_ratio:.3f} wall, {cpu_ratio:.3f} CPU")
        ratios.append(f"| {pattern}: {args.sessions:,} / {args.small:,} | {wall_ratio:.3f} | {cpu_ratio:.3f} |")
    runtime = time.perf_counter() - started
    out(f"runtime: {runtime:.1f} s")
    raw["runtime_seconds"] = runtime
    body = "\n".join(
        [
            f"Memory: {live:,} live sessions, {per_session:.0f} bytes per session (peak while building "
            f"{peak:.0f}), id strings included; a full gc.collect() with them alive: {pause:.0f} ms.",
            "",
            f"Cost per request (medians of {args.rounds} rounds of {args.ops:,} requests; see the script's "
            "docstring for the patterns):",
            "",
            *table,
            "",
            *ratios,
            "",
            f"Runtime {runtime:.0f} s.",
        ]
    )
    md, js = record.write(
        "bench_lineage", f"Session tree benchmark, {facts['date'][:10]}", body, raw, facts, args.out_dir
    )
    print(f"written: {md}, {js}", file=sys.stderr)


if __name__ == "__main__":
    main()
