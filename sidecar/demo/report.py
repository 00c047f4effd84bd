"""Metrics of a demo run and the side-by-side table ``sidecar demo`` prints."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import groupby

from sidecar.demo.workload import RequestRecord


@dataclass(frozen=True, slots=True)
class RunMetrics:
    """What one run of the workload measured.

    ``switches`` counts, per session, consecutive successful turns served by different workers.
    ``cached_ratio`` is cached prompt tokens / prompt tokens over successful requests (0.0 when
    there are none). Latencies are end-to-end (request sent -> ``[DONE]``) over successful
    requests, in milliseconds; ``nan`` when there are none.
    """

    requests: int
    errors: int
    switches: int
    prompt_tokens: int
    cached_tokens: int
    cached_ratio: float
    latency_p50_ms: float
    latency_p99_ms: float
    wall_s: float
    # p50 of sequential probe requests with nothing else in flight (nan when not measured).
    probe_p50_ms: float = math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; ``nan`` if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def count_switches(records: Iterable[RequestRecord]) -> int:
    """Worker changes between consecutive successful turns of each session."""
    ok = sorted((r for r in records if r.ok), key=lambda r: (r.session, r.turn))
    switches = 0
    for _, turns in groupby(ok, key=lambda r: r.session):
        workers = [r.worker for r in turns]
        switches += sum(a != b for a, b in zip(workers, workers[1:]))
    return switches


def summarize(records: Sequence[RequestRecord], *, wall_s: float) -> RunMetrics:
    """Reduce one run's records to its metrics."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    latencies = [r.latency_s * 1000 for r in ok]
    return RunMetrics(
        requests=len(records),
        errors=len(records) - len(ok),
        switches=count_switches(records),
        prompt_tokens=prompt,
        cached_tokens=cached,
        cached_ratio=cached / prompt if prompt else 0.0,
        latency_p50_ms=percentile(latencies, 50),
        latency_p99_ms=percentile(latencies, 99),
        wall_s=wall_s,
    )


def format_table(
    direct: RunMetrics,
    via_sidecar: RunMetrics,
    *,
    title: str = "",
    labels: tuple[str, str] = ("direct", "via sidecar"),
) -> str:
    """The two runs side by side as aligned plain text, ending with a newline."""
    added = via_sidecar.probe_p50_ms - direct.probe_p50_ms
    added_label = "sidecar added latency p50 (ms)"
    if math.isnan(added):
        added = via_sidecar.latency_p50_ms - direct.latency_p50_ms
    rows: list[tuple[str, str, str]] = [
        ("", labels[0], labels[1]),
        ("requests", str(direct.requests), str(via_sidecar.requests)),
        ("errors", str(direct.errors), str(via_sidecar.errors)),
        ("worker switches in sessions", str(direct.switches), str(via_sidecar.switches)),
        (
            "cached / prompt tokens",
            f"{direct.cached_tokens}/{direct.prompt_tokens}",
            f"{via_sidecar.cached_tokens}/{via_sidecar.prompt_tokens}",
        ),
        ("cached ratio", f"{direct.cached_ratio:.2f}", f"{via_sidecar.cached_ratio:.2f}"),
        ("latency p50 (ms)", f"{direct.latency_p50_ms:.1f}", f"{via_sidecar.latency_p50_ms:.1f}"),
        ("latency p99 (ms)", f"{direct.latency_p99_ms:.1f}", f"{via_sidecar.latency_p99_ms:.1f}"),
        ("probe latency p50 (ms)", f"{direct.probe_p50_ms:.2f}", f"{via_sidecar.probe_p50_ms:.2f}"),
        (added_label, "-", f"{added:+.2f}"),
        ("wall time (s)", f"{direct.wall_s:.2f}", f"{via_sidecar.wall_s:.2f}"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    w2 = max(len(r[2]) for r in rows)
    lines = [title] if title else []
    lines += [f"{a:<{w0}}  {b:>{w1}}  {c:>{w2}}".rstrip() for a, b, c in rows]
    return "\n".join(lines) + "\n"
