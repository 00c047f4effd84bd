"""``sidecar demo``: the same workload against a mock gateway, directly and through the sidecar.

Everything runs in this process on 127.0.0.1: the mock gateway (:mod:`sidecar.demo.gateway`),
the workload (:mod:`sidecar.demo.workload`) and the sidecar in ``dynamo_headers`` mode, which
turns each request's ``X-Correlation-ID`` into ``X-Dynamo-Session-ID``. The gateway is reset to
a cold state between the two runs, and both runs send the same conversations. The workload asks
each streamed answer for its usage (``stream_options.include_usage``) and sums what it read; the
sidecar's own accounting of the same responses (its ``/metrics``) is printed beside it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TextIO

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from sidecar.demo.gateway import MockGateway, create_gateway_app
from sidecar.demo.report import (
    AddedLatency,
    RunMetrics,
    SidecarAccounting,
    added_latency,
    format_table,
    percentile,
    summarize,
)
from sidecar.demo.workload import RequestRecord, probe_pairs, run_workload


class SidecarHandle(Protocol):
    """What the demo needs from a sidecar: start (binds and sets ``proxy_url``) and stop. One
    that also has an ``admin_url`` (the real sidecar) is asked for its own prompt-cache
    accounting there (``/metrics``)."""

    @property
    def proxy_url(self) -> str | None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


SidecarFactory = Callable[[str], SidecarHandle]
"""Builds a sidecar in front of the given upstream URL (not yet started)."""


def default_sidecar_factory(upstream_url: str) -> SidecarHandle:
    """The real sidecar in ``dynamo_headers`` mode on ephemeral loopback ports, with its own
    metrics registry and no configuration from the environment."""
    # Imported here: the app (and the CLI above it) may import this package.
    from prometheus_client import CollectorRegistry

    from sidecar.app import Sidecar
    from sidecar.config import build_config

    cfg = build_config(
        flags={"listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "upstream": upstream_url, "mode": "dynamo_headers"},
        env={},
    )
    sidecar: SidecarHandle = Sidecar(cfg, registry=CollectorRegistry())
    return sidecar


@dataclass(frozen=True, slots=True)
class DemoResult:
    """Both runs' numbers, the table that was printed, and the raw per-request records."""

    sessions: int
    turns: int
    workers: int
    direct: RunMetrics
    via_sidecar: RunMetrics
    # The sidecar's own prompt-cache accounting of its run (None: not read).
    sidecar_accounting: SidecarAccounting | None
    # What the sidecar adds to one request, from paired sequential probes.
    added_latency: AddedLatency
    direct_records: tuple[RequestRecord, ...]
    sidecar_records: tuple[RequestRecord, ...]
    table: str
    elapsed_s: float

    @property
    def ok(self) -> bool:
        """Both runs without errors, and no session moved between workers through the sidecar."""
        return self.direct.errors == 0 and self.via_sidecar.errors == 0 and self.via_sidecar.switches == 0


async def read_accounting(admin_url: str, responses: int = 0, timeout_s: float = 5.0) -> SidecarAccounting:
    """A sidecar's own prompt-cache accounting, summed over its deployments, modes and turns,
    from its ``/metrics`` (as an operator's Prometheus reads it). ``responses``: how many
    responses the client received whole: read again, every 20 ms for up to ``timeout_s``, until
    the sidecar counted that many (it counts a response once it saw the body's end, which can
    come a moment after the client had the last byte: the compiled build's stream thread sends
    it, then tells the event loop)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            counted = await _read_accounting(http, admin_url)
            if counted.reported + counted.unknown >= responses or time.monotonic() >= deadline:
                return counted
            await asyncio.sleep(0.02)


async def _read_accounting(http: aiohttp.ClientSession, admin_url: str) -> SidecarAccounting:
    async with http.get(admin_url.rstrip("/") + "/metrics") as resp:
        resp.raise_for_status()
        text = await resp.text()
    sums = {"prompt": 0.0, "cached": 0.0, "reported": 0.0, "unknown": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sidecar_prompt_tokens_total":
                sums["prompt"] += sample.value
            elif sample.name == "sidecar_cached_prompt_tokens_total":
                sums["cached"] += sample.value
            elif sample.name == "sidecar_usage_responses_total":
                sums["reported" if sample.labels.get("outcome") == "reported" else "unknown"] += sample.value
    return SidecarAccounting(int(sums["prompt"]), int(sums["cached"]), int(sums["reported"]), int(sums["unknown"]))


async def _timed_run(
    url: str, *, sessions: int, turns: int, seed: int, request_timeout_s: float
) -> tuple[list[RequestRecord], RunMetrics]:
    start = time.perf_counter()
    records = await run_workload(url, sessions=sessions, turns=turns, seed=seed, request_timeout_s=request_timeout_s)
    return records, summarize(records, wall_s=time.perf_counter() - start)


async def run_demo(
    *,
    sessions: int = 16,
    turns: int = 5,
    out: TextIO = sys.stdout,
    sidecar_factory: SidecarFactory = default_sidecar_factory,
    workers: int = 4,
    seed: int = 0,
    request_timeout_s: float = 10.0,
) -> DemoResult:
    """Start the mock gateway, run the workload directly, then through a sidecar built by
    ``sidecar_factory``, stop everything, print the comparison table to ``out`` and return
    both runs' numbers."""
    started = time.perf_counter()
    gateway = MockGateway(n_workers=workers)
    runner = web.AppRunner(create_gateway_app(gateway), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        gateway_url = f"http://127.0.0.1:{port}"
        run = functools.partial(
            _timed_run, sessions=sessions, turns=turns, seed=seed, request_timeout_s=request_timeout_s
        )

        direct_records, direct = await run(gateway_url)

        gateway.reset()
        sidecar = sidecar_factory(gateway_url)
        try:
            await sidecar.start()
            if not sidecar.proxy_url:
                raise RuntimeError("the sidecar started without a proxy URL")
            sidecar_records, via_sidecar = await run(sidecar.proxy_url)
            admin_url = getattr(sidecar, "admin_url", None)
            relayed = via_sidecar.requests - via_sidecar.errors
            accounting = await read_accounting(admin_url, relayed) if admin_url else None  # (before the probes)
            direct_ms, via_ms = await probe_pairs(gateway_url, sidecar.proxy_url)
        finally:
            await sidecar.stop()
        added = added_latency(direct_ms, via_ms)
        direct = dataclasses.replace(direct, probe_p50_ms=percentile(direct_ms, 50))
        via_sidecar = dataclasses.replace(via_sidecar, probe_p50_ms=percentile(via_ms, 50))
    finally:
        await runner.cleanup()

    title = (
        f"sidecar demo: {sessions} sessions x {turns} turns, streaming, mock gateway with "
        f"{workers} workers (Dynamo-style X-Dynamo-Session-ID affinity)"
    )
    table = format_table(direct, via_sidecar, added, title=title, accounting=accounting) + (
        "latency p50/p99: streamed requests end to end, concurrent, all in this one process; the probes\n"
        "and the added latency are measured apart, by small requests with nothing else in flight\n"
    )
    out.write(table)
    out.flush()
    return DemoResult(
        sessions=sessions,
        turns=turns,
        workers=workers,
        direct=direct,
        via_sidecar=via_sidecar,
        sidecar_accounting=accounting,
        added_latency=added,
        direct_records=tuple(direct_records),
        sidecar_records=tuple(sidecar_records),
        table=table,
        elapsed_s=time.perf_counter() - started,
    )
