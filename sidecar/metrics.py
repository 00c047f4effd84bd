"""Every Prometheus metric of the sidecar, in one place.

Label values come from closed sets only (deployment and mode names from the config, fixed
outcome / reason / kind enums), never from client input. The registry is injectable so tests
can build many apps in one process.
"""

from __future__ import annotations

from functools import lru_cache
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Latencies of LLM requests span milliseconds (errors, cache hits) to minutes (long generations).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# The sidecar's own cost is sub-millisecond when healthy.
ADDED_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)

UPSTREAM_ERROR_KINDS = ("connect", "timeout", "reset", "protocol")


def status_class(status: int) -> str:
    """``200 -> "2xx"``."""
    return f"{status // 100}xx" if 100 <= status < 600 else "other"


class Metrics:
    """The sidecar's metrics, registered on ``registry`` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "sidecar_requests_total", "Proxied requests by deployment, mode and response status class.",
            ("deployment", "mode", "status_class"), registry=r)
        self.duration = Histogram(
            "sidecar_request_duration_seconds", "Time from request head to last response byte.",
            ("deployment", "mode"), buckets=DURATION_BUCKETS, registry=r)
        self.ttfb = Histogram(
            "sidecar_time_to_first_byte_seconds", "Time from request head to the upstream's response head.",
            ("deployment", "mode"), buckets=DURATION_BUCKETS, registry=r)
        self.added = Histogram(
            "sidecar_added_latency_seconds",
            "Time the sidecar itself spent before forwarding a request (routing decision and rewrite).",
            ("deployment",), buckets=ADDED_BUCKETS, registry=r)
        self.upstream_errors = Counter(
            "sidecar_upstream_errors_total", "Upstream failures by kind (connect, timeout, reset, protocol).",
            ("deployment", "kind"), registry=r)
        self.headers_injected = Counter(
            "sidecar_headers_injected_total", "Requests that got affinity headers from a mode.",
            ("mode",), registry=r)
        self.body_rewrites = Counter(
            "sidecar_body_rewrites_total",
            "Body-mode outcomes: rewritten, passthrough_not_object, passthrough_invalid_json, rejected.",
            ("mode", "outcome"), registry=r)
        self.plugin_errors = Counter(
            "sidecar_plugin_errors_total", "Exceptions raised by a mode, by hook.", ("mode", "hook"), registry=r)
        self.rejected = Counter(
            "sidecar_rejected_requests_total", "Requests the sidecar answered itself, by reason.",
            ("reason",), registry=r)
        self.sessions_ended = Counter(
            "sidecar_sessions_ended_total", "Sessions ended, by reason.", ("reason",), registry=r)
        self.end_actions = Counter(
            "sidecar_end_actions_total", "End-of-session calls to the upstream, by mode and outcome.",
            ("mode", "outcome"), registry=r)
        self.affinity_turns = Counter(
            "sidecar_affinity_turns_total",
            "Turns whose worker the upstream named, by outcome: first (a session's first), "
            "same_worker (as its previous turn), moved (another worker than its previous turn).",
            ("outcome",), registry=r)
        self.in_flight = Gauge("sidecar_in_flight_requests", "Requests being proxied now.", registry=r)

        # prometheus_client's .labels() costs a lock and a dict lookup with tuple building each call;
        # the hot path goes through these small caches instead (bounded by the closed label sets).
        self.request_counter = lru_cache(maxsize=1024)(self.requests.labels)
        self.duration_hist = lru_cache(maxsize=256)(self.duration.labels)
        self.ttfb_hist = lru_cache(maxsize=256)(self.ttfb.labels)
        self.added_hist = lru_cache(maxsize=256)(self.added.labels)
        self.upstream_error = lru_cache(maxsize=256)(self.upstream_errors.labels)
        self.headers_injected_for = lru_cache(maxsize=256)(self.headers_injected.labels)
        self.affinity_turn = lru_cache(maxsize=8)(self.affinity_turns.labels)

    def watch_tree(self, tree: Any) -> None:
        """Expose the session tree's gauges and counters, read at scrape time (no hot-path cost)."""
        self.registry.register(_TreeCollector(tree))

    def watch_deployments(self, deployments: Any, store: Any) -> None:
        """Expose upstream health, failovers and the API session store, read at scrape time."""
        self.registry.register(_DeploymentCollector(deployments, store))


class _TreeCollector(Collector):
    def __init__(self, tree: Any) -> None:
        self.tree = tree

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        t = self.tree
        yield GaugeMetricFamily("sidecar_live_sessions", "Sessions in the lineage tree.", value=t.live_sessions)
        yield GaugeMetricFamily("sidecar_live_trees", "Session trees (roots) in the lineage tree.",
                                value=t.live_trees)
        yield CounterMetricFamily("sidecar_session_evictions", "Sessions evicted at the live-session cap.",
                                  value=t.evictions)
        yield CounterMetricFamily("sidecar_tombstone_reuses",
                                  "Ended session ids that came back and started a new session.",
                                  value=t.tombstone_reuses)
        yield CounterMetricFamily("sidecar_root_conflicts",
                                  "Client root headers that contradicted the derived root (derived root kept).",
                                  value=t.root_conflicts)


class _DeploymentCollector(Collector):
    def __init__(self, deployments: Any, store: Any) -> None:
        self.deployments = deployments
        self.store = store

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        healthy = GaugeMetricFamily("sidecar_upstream_healthy",
                                    "1 while an upstream is considered healthy (active checks, passive marks).",
                                    labels=("deployment", "upstream"))
        failovers = CounterMetricFamily("sidecar_upstream_failovers",
                                        "Tree requests sent to a lower-ranked upstream because a better one was "
                                        "unhealthy.", labels=("deployment",))
        for d in self.deployments:
            b = d.balancer
            for u in d.upstreams:
                healthy.add_metric((d.name, u.url), 1.0 if b.is_healthy(u) else 0.0)
            failovers.add_metric((d.name,), b.failovers)
        yield healthy
        yield failovers
        yield GaugeMetricFamily("sidecar_api_sessions_active", "Active sessions created through the sessions API.",
                                value=self.store.active)
        yield GaugeMetricFamily("sidecar_api_session_tombstones",
                                "Closed or expired API sessions remembered for 410 answers.",
                                value=self.store.tombstones)
