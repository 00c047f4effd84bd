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


@dataclass(frozen=True, slots=True)
class SidecarAccounting:
    """The sidecar's own prompt-cache accounting of a run, as its ``/metrics`` count it: the
    prompt and cached prompt tokens the responses reported, how many responses reported them,
    how many did not."""

    prompt_tokens: int
    cached_tokens: int
    reported: int
    unknown: int

    def agrees_with(self, run: RunMetrics) -> bool:
        """The same counts as the workload's own (read by the client from the same responses)."""
        ok = run.requests - run.errors
        return (self.prompt_tokens, self.cached_tokens, self.reported, self.unknown) == (
            run.prompt_tokens,
            run.cached_tokens,
            ok,
            0,
        )


@dataclass(frozen=True, slots=True)
class AddedLatency:
    """What the sidecar adds to one request, from ``pairs`` pairs of small sequential requests
    (one direct, one through the sidecar, back to back, nothing else in flight): the median of
    the per-pair differences and its 95% confidence interval (distribution-free, from order
    statistics). The noise floor is the interval itself: when it reaches 0 the added latency
    is within measurement noise, at most ``high_ms``; a negative figure is never shown."""

    median_ms: float
    low_ms: float
    high_ms: float
    pairs: int

    @property
    def measurable(self) -> bool:
        """Above the noise floor: the whole interval is above 0."""
        return self.low_ms > 0

    def cell(self) -> str:
        """The table's figure: ``+0.09``, or ``< 0.03`` within measurement noise."""
        return f"{self.median_ms:+.2f}" if self.measurable else f"< {max(self.high_ms, 0.01):.2f}"

    def note(self) -> str:
        """What the figure means, one line."""
        if self.measurable:
            return (
                f"sidecar added latency: median of {self.pairs} paired sequential requests, 95% confidence "
                f"{self.low_ms:+.3f} to {self.high_ms:+.3f} ms"
            )
        return (
            f"sidecar added latency: within measurement noise (at most {max(self.high_ms, 0.01):.2f} ms: "
            f"the 95% confidence interval of the median of {self.pairs} paired sequential requests reaches 0)"
        )


def added_latency(direct_ms: Sequence[float], via_ms: Sequence[float]) -> AddedLatency:
    """The added latency of paired measurements (``via_ms[i]`` pairs with ``direct_ms[i]``)."""
    diffs = sorted(v - d for d, v in zip(direct_ms, via_ms, strict=True))
    n = len(diffs)
    if not n:
        return AddedLatency(math.nan, math.nan, math.nan, 0)
    # The median's 95% interval lies between the order statistics n/2 -/+ 1.96 sqrt(n)/2.
    k = max(0, math.floor(n / 2 - 0.98 * math.sqrt(n)))
    return AddedLatency(percentile(diffs, 50), diffs[k], diffs[n - 1 - k], n)


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
    added: AddedLatency,
    *,
    title: str = "",
    labels: tuple[str, str] = ("direct", "via sidecar"),
    accounting: SidecarAccounting | None = None,
) -> str:
    """The two runs side by side as aligned plain text, the sidecar's own accounting beside the
    workload's (``accounting``; "-" when it was not read), then what the added latency means and,
    when read, whether the accounting agrees; ending with a newline."""
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
        (
            "  the sidecar's own count",
            "-",
            "-" if accounting is None else f"{accounting.cached_tokens}/{accounting.prompt_tokens}",
        ),
        ("latency p50 (ms)", f"{direct.latency_p50_ms:.1f}", f"{via_sidecar.latency_p50_ms:.1f}"),
        ("latency p99 (ms)", f"{direct.latency_p99_ms:.1f}", f"{via_sidecar.latency_p99_ms:.1f}"),
        ("probe latency p50 (ms)", f"{direct.probe_p50_ms:.2f}", f"{via_sidecar.probe_p50_ms:.2f}"),
        ("sidecar added latency (ms)", "-", added.cell()),
        ("wall time (s)", f"{direct.wall_s:.2f}", f"{via_sidecar.wall_s:.2f}"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    w2 = max(len(r[2]) for r in rows)
    lines = [title] if title else []
    lines += [f"{a:<{w0}}  {b:>{w1}}  {c:>{w2}}".rstrip() for a, b, c in rows]
    lines.append(added.note())
    if accounting is not None:
        lines.append(accounting_note(accounting, via_sidecar))
    return "\n".join(lines) + "\n"


def accounting_note(accounting: SidecarAccounting, run: RunMetrics) -> str:
    """What the sidecar's own count says of the run, one line."""
    counted = (
        f"{accounting.reported} responses reported their usage, {accounting.unknown} did not "
        "(sidecar_prompt_tokens_total, sidecar_cached_prompt_tokens_total, sidecar_usage_responses_total)"
    )
    if accounting.agrees_with(run):
        return f"the sidecar's own count agrees with the workload's: {counted}"
    return f"the sidecar's own count differs from the workload's: {counted}"
