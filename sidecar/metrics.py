"""Every Prometheus metric of the sidecar, in one place.

Label values come from closed sets only (deployment and mode names from the config, fixed
outcome / reason / kind enums), never from client input. The registry is injectable so tests
can build many apps in one process.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from time import perf_counter
from typing import Any

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Latencies of LLM requests span milliseconds (errors, cache hits) to minutes (long generations).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# The sidecar's own cost is sub-millisecond when healthy.
ADDED_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)

# A collector pause of a millisecond shows in streamed events; a large heap's reach seconds.
GC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

UPSTREAM_ERROR_KINDS = ("connect", "timeout", "reset", "protocol")


def status_class(status: int) -> str:
    """``200 -> "2xx"``."""
    return f"{status // 100}xx" if 100 <= status < 600 else "other"


# -- lock-free metrics -------------------------------------------------------------------------
# prometheus_client's metric objects take a lock on every inc/observe (several per request: a
# histogram observation is two locked increments). Everything here runs on one event loop, so
# the hot path uses plain attribute arithmetic and the samples are built only when scraped.


class _Value:
    """A counter or gauge child."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class _Buckets:
    """A histogram child: per-bucket counts (last one is +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # The first bucket whose bound is >= value, by a scan from the smallest: the request
        # path's values land in the first buckets, and compiled this is a loop over C doubles.
        bounds = self.bounds
        n = len(bounds)
        i = 0
        while i < n:
            bound = bounds[i]
            if bound >= value:
                break
            i += 1
        self.counts[i] += 1
        self.sum += value


class _Family:
    """A metric with a fixed label set; ``labels(*values)`` returns the (cached) child."""

    def __init__(
        self, kind: str, name: str, doc: str, labelnames: Sequence[str] = (), buckets: tuple[float, ...] = ()
    ) -> None:
        self.kind = kind
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self.buckets = tuple(float(b) for b in buckets)
        self.children: dict[tuple[str, ...], Any] = {}
        if not self.labelnames:
            self._solo = self.labels()

    def labels(self, *values: str) -> Any:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            child = self.children[values] = _Buckets(self.buckets) if self.kind == "histogram" else _Value()
        return child

    # An unlabelled family is its own only child.
    def inc(self, amount: float = 1.0) -> None:
        self._solo.inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self._solo.dec(amount)

    def set(self, value: float) -> None:
        self._solo.set(value)

    def collect(self) -> Any:
        if self.kind == "counter":
            fam: Any = CounterMetricFamily(self.name.removesuffix("_total"), self.doc, labels=self.labelnames)
            for values, child in self.children.items():
                fam.add_metric(values, child.value)
        elif self.kind == "gauge":
            fam = GaugeMetricFamily(self.name, self.doc, labels=self.labelnames)
            for values, child in self.children.items():
                fam.add_metric(values, child.value)
        else:
            fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
            for values, child in self.children.items():
                cumulative, out = 0, []
                for bound, count in zip((*self.buckets, float("inf")), child.counts):
                    cumulative += count
                    out.append((floatToGoString(bound), cumulative))
                fam.add_metric(values, out, child.sum)
        return fam


class _FamilyCollector(Collector):
    def __init__(self, families: list[_Family]) -> None:
        self.families = families

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        for family in self.families:
            yield family.collect()


class DeploymentStats:
    """A deployment's hot-path metric children, looked up once instead of per request."""

    __slots__ = ("added", "ttfb", "duration", "headers_injected", "_rewritten", "_rewrites", "_requests", "_by_class")

    def __init__(self, m: Metrics, deployment: str, mode: str) -> None:
        self.added = m.added.labels(deployment)
        self.ttfb = m.ttfb.labels(deployment, mode)
        self.duration = m.duration.labels(deployment, mode)
        self.headers_injected = m.headers_injected.labels(deployment, mode)
        self._rewritten: _Value | None = None  # created by the first rewrite: no series before it
        self._rewrites = (m.body_rewrites, mode)
        self._requests = (m.requests, deployment, mode)
        self._by_class: dict[int, _Value] = {}

    def rewritten(self) -> _Value:
        """The ``sidecar_body_rewrites_total{outcome="rewritten"}`` child of the mode."""
        child = self._rewritten
        if child is None:
            family, mode = self._rewrites
            child = self._rewritten = family.labels(mode, "rewritten")
        return child

    def request(self, status: int) -> _Value:
        """The ``sidecar_requests_total`` child of ``status``'s class."""
        child = self._by_class.get(status // 100)
        if child is None:
            family, deployment, mode = self._requests
            child = self._by_class[status // 100] = family.labels(deployment, mode, status_class(status))
        return child


class Metrics:
    """The sidecar's metrics, registered on ``registry`` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        families: list[_Family] = []

        def family(
            kind: str, name: str, doc: str, labels: Sequence[str] = (), buckets: tuple[float, ...] = ()
        ) -> _Family:
            f = _Family(kind, name, doc, labels, buckets)
            families.append(f)
            return f

        self.requests = family(
            "counter",
            "sidecar_requests_total",
            "Proxied requests by deployment, mode and response status class.",
            ("deployment", "mode", "status_class"),
        )
        self.duration = family(
            "histogram",
            "sidecar_request_duration_seconds",
            "Time from request head to last response byte.",
            ("deployment", "mode"),
            DURATION_BUCKETS,
        )
        self.ttfb = family(
            "histogram",
            "sidecar_time_to_first_byte_seconds",
            "Time from request head to the upstream's response head.",
            ("deployment", "mode"),
            DURATION_BUCKETS,
        )
        self.added = family(
            "histogram",
            "sidecar_added_latency_seconds",
            "Time the sidecar itself spent before forwarding a request (routing decision and rewrite).",
            ("deployment",),
            ADDED_BUCKETS,
        )
        self.upstream_errors = family(
            "counter",
            "sidecar_upstream_errors_total",
            "Upstream failures by kind (connect, timeout, reset, protocol).",
            ("deployment", "kind"),
        )
        self.headers_injected = family(
            "counter",
            "sidecar_headers_injected_total",
            "Requests that got affinity headers from a mode.",
            ("deployment", "mode"),
        )
        self.body_rewrites = family(
            "counter",
            "sidecar_body_rewrites_total",
            "Body-mode outcomes: rewritten, passthrough_not_object, passthrough_invalid_json, rejected.",
            ("mode", "outcome"),
        )
        self.plugin_errors = family(
            "counter", "sidecar_plugin_errors_total", "Exceptions raised by a mode, by hook.", ("mode", "hook")
        )
        self.rejected = family(
            "counter",
            "sidecar_rejected_requests_total",
            "Requests the sidecar answered itself, by reason.",
            ("reason",),
        )
        self.sessions_ended = family(
            "counter",
            "sidecar_sessions_ended_total",
            "Sessions ended, by deployment and reason.",
            ("deployment", "reason"),
        )
        self.end_actions = family(
            "counter",
            "sidecar_end_actions_total",
            "End-of-session calls to the upstream, by mode and outcome.",
            ("mode", "outcome"),
        )
        self.affinity_turns = family(
            "counter",
            "sidecar_affinity_turns_total",
            "Turns whose worker the upstream named, by outcome: first (a session's first), "
            "same_worker (as its previous turn), moved (another worker than its previous turn).",
            ("deployment", "outcome"),
        )
        self.prompt_tokens = family(
            "counter",
            "sidecar_prompt_tokens_total",
            "Prompt tokens the upstream's responses reported, by deployment, mode and turn bucket "
            "(turn 1, 2, 3-5, 6-10, 11+ of its session); only responses that also reported their cached part.",
            ("deployment", "mode", "turn"),
        )
        self.cached_prompt_tokens = family(
            "counter",
            "sidecar_cached_prompt_tokens_total",
            "Of those prompt tokens, the ones the upstream found in its prefix cache, by deployment, mode and "
            "turn bucket: divided by sidecar_prompt_tokens_total, the cached ratio.",
            ("deployment", "mode", "turn"),
        )
        self.usage_responses = family(
            "counter",
            "sidecar_usage_responses_total",
            "Responses to requests of a session, by what they said of their prompt-cache usage: reported, "
            "missing, no_cached_count (a prompt count without its cached part), malformed, unreadable.",
            ("deployment", "mode", "outcome"),
        )
        self.in_flight = family("gauge", "sidecar_in_flight_requests", "Requests being proxied now.")
        self.gc_pauses = family(
            "histogram",
            "sidecar_gc_pause_seconds",
            "Collections of Python's cyclic garbage collector by generation (0, 1, 2: full), timed: "
            "the process served nothing meanwhile.",
            ("generation",),
            GC_BUCKETS,
        )
        self.build_info = family(
            "gauge",
            "sidecar_build_info",
            "Always 1: the sidecar's version, engine and whether it runs compiled.",
            ("version", "engine", "compiled"),
        )
        self.registry.register(_FamilyCollector(families))
        self._family = family  # (watch_state adds families later; the collector reads the same list)
        # The standard process_*, python_info and python_gc_* series, on this registry (not the
        # global one), so every app in a process has its own.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

        # Hot-path shortcuts (children are cached per label values; the label sets are closed).
        self.request_counter = self.requests.labels
        self.duration_hist = self.duration.labels
        self.ttfb_hist = self.ttfb.labels
        self.added_hist = self.added.labels
        self.upstream_error = self.upstream_errors.labels
        self.headers_injected_for = self.headers_injected.labels
        self.affinity_turn = self.affinity_turns.labels

    def watch_state(self) -> None:
        """Add the shared session store's metrics (only a sidecar with one exports them)."""
        if hasattr(self, "state_up"):
            return
        family = self._family
        self.state_up = family(
            "gauge",
            "sidecar_state_store_up",
            "1 while the shared session store answers, 0 while the sidecar serves on local "
            "state (circuit breaker open).",
        )
        self.state_ops = family(
            "counter",
            "sidecar_state_ops_total",
            "Round trips to the shared session store, by operation and outcome (ok, error).",
            ("op", "outcome"),
        )
        self.state_latency = family(
            "histogram",
            "sidecar_state_latency_seconds",
            "Latency of round trips to the shared session store, by operation.",
            ("op",),
            ADDED_BUCKETS,
        )
        self.state_dropped = family(
            "counter",
            "sidecar_state_dropped_writes_total",
            "Session changes dropped unwritten (the write-behind table was full during a store outage).",
        )
        self.state_round_trips = family(
            "counter", "sidecar_state_round_trips_total", "Round trips to the shared session store."
        )
        self.state_commands = family(
            "counter",
            "sidecar_state_commands_total",
            "Commands sent to the shared session store (a script call counts one).",
        )

    def set_build_info(self, version: str, engine: str, compiled: bool) -> None:
        """``sidecar_build_info{version, engine, compiled} 1`` (once, at start)."""
        self.build_info.labels(version, engine, "true" if compiled else "false").set(1)

    def for_deployment(self, deployment: str, mode: str) -> DeploymentStats:
        """The per-request metric children of one deployment, resolved once."""
        return DeploymentStats(self, deployment, mode)

    def watch_tree(self, tree: Any) -> None:
        """Expose the session tree's gauges and counters, read at scrape time (no hot-path cost)."""
        self.registry.register(_TreeCollector(tree))

    def watch_poller(self, poller: Any) -> None:
        """Expose the fast engine's idle polling time (``sidecar.engine.idle_poll``), read at scrape time."""
        self.registry.register(_PollerCollector(poller))

    def watch_stream_reads(self, direct: Any) -> None:
        """Expose the fast engine's stream thread: the bodies it relayed, its reads and the reads
        it handed back to the event loop (``sidecar.engine.direct.DirectReads``, compiled build),
        read at scrape time."""
        self.registry.register(_StreamReadsCollector(direct))

    def watch_deployments(self, deployments: Any, store: Any) -> None:
        """Expose upstream health, failovers and the API session store, read at scrape time."""
        self.registry.register(_DeploymentCollector(deployments, store))


class GcPauses:
    """Times each collection of Python's cyclic garbage collector into ``sidecar_gc_pause_seconds``
    of ``metrics`` (a ``gc.callbacks`` entry from :meth:`start` to :meth:`stop`). The collector
    runs for the whole process: while several apps run in one, each counts every collection."""

    __slots__ = ("_by_generation", "_began")

    def __init__(self, metrics: Metrics) -> None:
        self._by_generation = tuple(metrics.gc_pauses.labels(str(g)) for g in range(3))
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = perf_counter()
        elif self._began:  # (not a collection that was under way when this was added)
            self._by_generation[info["generation"]].observe(perf_counter() - self._began)
            self._began = 0.0

    def start(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def stop(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


class _SourceCollector(Collector):
    """Metrics read from one object at scrape time (``source``): nothing on the hot path."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def describe(self) -> list[Any]:
        return []


class _TreeCollector(_SourceCollector):
    def collect(self) -> Iterator[Any]:
        t = self.source
        yield GaugeMetricFamily("sidecar_live_sessions", "Sessions in the lineage tree.", value=t.live_sessions)
        yield GaugeMetricFamily("sidecar_live_trees", "Session trees (roots) in the lineage tree.", value=t.live_trees)
        yield CounterMetricFamily(
            "sidecar_session_evictions", "Sessions evicted at the live-session cap.", value=t.evictions
        )
        yield CounterMetricFamily(
            "sidecar_tombstone_reuses",
            "Ended session ids that came back and started a new session.",
            value=t.tombstone_reuses,
        )
        yield CounterMetricFamily(
            "sidecar_root_conflicts",
            "Client root headers that contradicted the derived root (derived root kept).",
            value=t.root_conflicts,
        )
        yield GaugeMetricFamily(
            "sidecar_held_ancestors",
            "Ended sessions kept in the lineage tree as ancestors of live ones (counted in the cap).",
            value=t.held_ancestors,
        )
        yield CounterMetricFamily(
            "sidecar_lineage_dropped",
            "New sessions whose parent was ignored because held ancestors filled half the cap.",
            value=t.lineage_dropped,
        )


class _PollerCollector(_SourceCollector):
    def collect(self) -> Iterator[Any]:
        yield CounterMetricFamily(
            "sidecar_idle_poll_seconds",
            "Time the fast engine's event loop polled for I/O instead of sleeping (work done meanwhile included).",
            value=self.source.polled_seconds(),
        )


class _StreamReadsCollector(_SourceCollector):
    def collect(self) -> Iterator[Any]:
        d = self.source
        yield CounterMetricFamily(
            "sidecar_streams_read_directly",
            "Long response bodies (token streams, large bodies) handed to the fast engine's stream thread "
            "(one handed back and enrolled again counts again).",
            value=d.enrolled,
        )
        yield CounterMetricFamily(
            "sidecar_stream_reads",
            "Reads the stream thread made of those bodies (each one recv: one or more events).",
            value=d.reads,
        )
        yield CounterMetricFamily(
            "sidecar_stream_handbacks",
            "Times the stream thread handed one of those bodies back to the event loop (its end, a read "
            "it does not pass through, a full client socket, a close or an error).",
            value=d.handed_back,
        )


class _DeploymentCollector(Collector):
    def __init__(self, deployments: Any, store: Any) -> None:
        self.deployments = deployments
        self.store = store

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        healthy = GaugeMetricFamily(
            "sidecar_upstream_healthy",
            "1 while an upstream is considered healthy (active checks, passive marks).",
            labels=("deployment", "upstream"),
        )
        failovers = CounterMetricFamily(
            "sidecar_upstream_failovers",
            "Tree requests sent to a lower-ranked upstream because a better one was unhealthy.",
            labels=("deployment",),
        )
        for d in self.deployments:
            b = d.balancer
            for u in d.upstreams:
                healthy.add_metric((d.name, u.display), 1.0 if b.is_healthy(u) else 0.0)  # no credentials
            failovers.add_metric((d.name,), b.failovers)
        yield healthy
        yield failovers
        yield GaugeMetricFamily(
            "sidecar_api_sessions_active", "Active sessions created through the sessions API.", value=self.store.active
        )
        yield GaugeMetricFamily(
            "sidecar_api_session_tombstones",
            "Closed or expired API sessions remembered for 410 answers.",
            value=self.store.tombstones,
        )
