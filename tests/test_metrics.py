"""The lock-free metric families render as Prometheus expects."""

from __future__ import annotations

import gc

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.metrics import ADDED_BUCKETS, Metrics


def samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(m.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


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
        ADDED_BUCKETS[0] * 2.01 + 10.5
    )


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
    assert (
        m.registry.get_sample_value("sidecar_requests_total", {"deployment": "d", "mode": "m", "status_class": "2xx"})
        == 3
    )


def test_wrong_label_count_is_refused():
    m = Metrics(CollectorRegistry())
    with pytest.raises(ValueError, match="sidecar_requests_total"):
        m.requests.labels("only-one")


async def test_metrics_after_a_known_workload(upstream, start_sidecar):
    import aiohttp

    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_nvext", limits={"max_body_bytes": 4096})
    async with aiohttp.ClientSession() as s:
        for turn in (1, 2, 3):  # one session, 3 turns, the last final
            headers = {"X-Correlation-ID": "m-1", **({"X-Session-Final": "true"} if turn == 3 else {})}
            async with s.post(f"{sc.proxy_url}/v1/chat/completions", data=b'{"model": "m"}', headers=headers) as r:
                assert r.status == 200
        async with s.post(
            f"{sc.proxy_url}/v1/chat/completions", data=b"[1, 2]", headers={"X-Correlation-ID": "m-2"}
        ) as r:
            assert r.status == 200
        async with s.post(
            f"{sc.proxy_url}/v1/chat/completions", data=b"x" * 5000, headers={"X-Correlation-ID": "m-3"}
        ) as r:
            assert r.status == 413
        async with s.get(f"{sc.proxy_url}/status/503") as r:
            assert r.status == 503
        async with s.get(f"{sc.admin_url}/metrics") as r:
            text = await r.text()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    dep = (("deployment", "default"), ("mode", "dynamo_nvext"))
    assert got[("sidecar_requests_total", (*dep, ("status_class", "2xx")))] == 4
    assert got[("sidecar_requests_total", (*dep, ("status_class", "4xx")))] == 1
    assert got[("sidecar_requests_total", (*dep, ("status_class", "5xx")))] == 1
    assert got[("sidecar_request_duration_seconds_count", dep)] == 5  # proxied (the 413 never was)
    assert got[("sidecar_time_to_first_byte_seconds_count", dep)] == 5
    assert got[("sidecar_added_latency_seconds_count", (("deployment", "default"),))] == 5
    assert got[("sidecar_body_rewrites_total", (("mode", "dynamo_nvext"), ("outcome", "rewritten")))] == 3
    assert got[("sidecar_body_rewrites_total", (("mode", "dynamo_nvext"), ("outcome", "passthrough_not_object")))] == 1
    assert got[("sidecar_headers_injected_total", dep)] == 0  # a body mode adds none
    assert got[("sidecar_rejected_requests_total", (("reason", "body_too_large"),))] == 1
    assert got[("sidecar_sessions_ended_total", (("deployment", "default"), ("reason", "final_turn_completed")))] == 1
    # m-1 ended with its final turn; m-3 was refused before admission (its body was too large).
    assert got[("sidecar_live_sessions", ())] == 1
    assert got[("sidecar_in_flight_requests", ())] == 0


async def test_gc_pauses_are_timed_per_generation_while_the_app_runs(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url)
    watcher = sc._gc_pauses
    assert watcher in gc.callbacks

    async def pauses() -> dict[str, tuple[float, float]]:
        async with aiohttp.ClientSession() as s, s.get(f"{sc.admin_url}/metrics") as r:
            text = await r.text()
        got = {
            (s.name, s.labels.get("generation")): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name.startswith("sidecar_gc_pause_seconds")
        }
        return {
            g: (got[("sidecar_gc_pause_seconds_count", g)], got[("sidecar_gc_pause_seconds_sum", g)]) for g in "012"
        }

    before = await pauses()
    gc.collect(2)
    gc.collect(0)
    after = await pauses()
    # (at least: the process may also have collected by itself meanwhile)
    assert after["2"][0] >= before["2"][0] + 1 and after["2"][1] > before["2"][1]
    assert after["0"][0] >= before["0"][0] + 1
    await sc.stop()
    assert watcher not in gc.callbacks  # a stopped app no longer times the process's collections
    full = sc.metrics.gc_pauses.labels("2")
    counted = sum(full.counts)
    gc.collect(2)
    assert sum(full.counts) == counted
