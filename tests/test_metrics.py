"""The lock-free metric families render as Prometheus expects."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from sidecar.metrics import ADDED_BUCKETS, Metrics


def samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(m.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_histogram_buckets_are_cumulative_and_le_inclusive():
    m = Metrics(CollectorRegistry())
    h = m.added_hist("d")
    for v in (ADDED_BUCKETS[0], ADDED_BUCKETS[0] * 1.01, 0.5, 10.0):
        h.observe(v)
    got = samples(m)
    key = lambda le: ("sidecar_added_latency_seconds_bucket", (("deployment", "d"), ("le", le)))  # noqa: E731
    assert got[key("5e-05")] == 1  # a value equal to a bound is in that bucket
    assert got[key("0.0001")] == 2
    assert got[key("0.1")] == 2
    assert got[key("+Inf")] == 4
    assert got[("sidecar_added_latency_seconds_count", (("deployment", "d"),))] == 4
    assert got[("sidecar_added_latency_seconds_sum", (("deployment", "d"),))] == pytest.approx(
        ADDED_BUCKETS[0] * 2.01 + 10.5)


def test_counters_and_gauges():
    m = Metrics(CollectorRegistry())
    m.request_counter("d", "m", "2xx").inc()
    m.request_counter("d", "m", "2xx").inc(2)
    m.in_flight.inc()
    m.in_flight.inc()
    m.in_flight.dec()
    got = samples(m)
    assert got[("sidecar_requests_total", (("deployment", "d"), ("mode", "m"), ("status_class", "2xx")))] == 3
    assert got[("sidecar_in_flight_requests", ())] == 1
    assert m.registry.get_sample_value("sidecar_requests_total",
                                       {"deployment": "d", "mode": "m", "status_class": "2xx"}) == 3


def test_wrong_label_count_is_refused():
    m = Metrics(CollectorRegistry())
    with pytest.raises(ValueError, match="sidecar_requests_total"):
        m.requests.labels("only-one")
