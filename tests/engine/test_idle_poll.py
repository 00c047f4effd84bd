"""Idle polling: when the fast engine's loop polls instead of sleeping, and what it costs.

The poller's rules run on a fake clock and a loop that records what is scheduled (exact, no
timing); the wire tests run the engine with it and read ``sidecar_idle_poll_seconds_total``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.config import build_config
from sidecar.engine import idle_poll
from sidecar.engine.idle_poll import COOLDOWN, MIN_BUSY, PERIOD, IdlePoller, cpu_quota
from sidecar.errors import ConfigError
from tests.conftest import StartSidecar
from tests.upstream import RecordingUpstream

WINDOW = 200e-6
US = 1e-6


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class RecordingLoop:
    """Records ``call_soon`` callbacks; ``run_one`` runs the oldest (one loop iteration's worth)."""

    def __init__(self) -> None:
        self.ready: list[Callable[[], Any]] = []

    def call_soon(self, cb: Callable[[], Any]) -> None:
        self.ready.append(cb)

    def run_one(self) -> None:
        self.ready.pop(0)()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(idle_poll, "perf_counter", c)
    return c


def poller(window: float = WINDOW) -> tuple[IdlePoller, RecordingLoop]:
    loop = RecordingLoop()
    return IdlePoller(loop, window), loop  # type: ignore[arg-type]


def test_one_event_or_events_far_apart_never_poll(clock: Clock) -> None:
    p, loop = poller()
    for _ in range(50):
        p.note()
        clock.advance(WINDOW + 1 * US)
    assert not p.running and loop.ready == []
    assert p.polled_seconds() == 0.0


def test_second_close_event_polls_until_a_window_passes_without_one(clock: Clock) -> None:
    p, loop = poller()
    p.note()
    clock.advance(150 * US)
    p.note()
    assert p.running and len(loop.ready) == 1
    # Work, then events every 150 us: every tick schedules the next one.
    for _ in range(5):
        clock.advance(60 * US)  # the reads' work
        loop.run_one()
        assert len(loop.ready) == 1
        clock.advance(150 * US)
        p.note()
    clock.advance(60 * US)
    loop.run_one()  # ends the last read's work
    # Empty ticks until the window has passed since that work ended.
    clock.advance(WINDOW - 1 * US)
    loop.run_one()
    assert p.running and len(loop.ready) == 1
    clock.advance(2 * US)
    loop.run_one()
    assert not p.running and loop.ready == []  # the loop may sleep
    assert p.polled_seconds() == pytest.approx(6 * 60 * US + 5 * 150 * US + WINDOW + 1 * US)


def test_a_period_with_too_little_work_stops_polling_for_the_cooldown(clock: Clock) -> None:
    p, loop = poller()
    p.note()
    clock.advance(100 * US)
    p.note()
    # Events every 100 us that take 10 us each: 10% busy, under MIN_BUSY.
    assert MIN_BUSY > 0.1
    ticks = 0
    while loop.ready:
        clock.advance(10 * US)
        loop.run_one()
        ticks += 1
        if not p.running:
            break
        clock.advance(90 * US)
        p.note()
    assert not p.running and loop.ready == []
    assert ticks == pytest.approx(PERIOD / (100 * US), abs=1)
    assert p.polled_seconds() == pytest.approx(PERIOD, abs=100 * US)
    # Close events during the cooldown do not restart it; after it, they do.
    for _ in range(int(COOLDOWN / (100 * US)) - 2):
        clock.advance(100 * US)
        p.note()
        assert not p.running and loop.ready == []
    clock.advance(COOLDOWN)
    p.note()
    clock.advance(100 * US)
    p.note()
    assert p.running and len(loop.ready) == 1


def test_enough_work_keeps_polling_past_periods(clock: Clock) -> None:
    p, loop = poller()
    p.note()
    clock.advance(100 * US)
    p.note()
    # 40 us of work per 100 us: 40% busy, over MIN_BUSY, for ten periods.
    assert MIN_BUSY < 0.4
    for _ in range(int(10 * PERIOD / (100 * US))):
        clock.advance(40 * US)
        loop.run_one()
        assert p.running and len(loop.ready) == 1
        clock.advance(60 * US)
        p.note()
    assert p.polled_seconds() == pytest.approx(10 * PERIOD, rel=0.01)


def test_window_zero_never_polls(clock: Clock) -> None:
    p, loop = poller(0.0)
    for _ in range(100):
        p.note()
        clock.advance(1 * US)
    assert not p.running and loop.ready == []


def test_stop_ends_polling_at_the_next_tick(clock: Clock) -> None:
    p, loop = poller()
    p.note()
    clock.advance(10 * US)
    p.note()
    assert p.running
    p.stop()
    clock.advance(10 * US)
    p.note()  # an event still arriving keeps nothing alive
    loop.run_one()
    assert not p.running and loop.ready == []
    clock.advance(10 * US)
    p.note()
    clock.advance(10 * US)
    p.note()
    assert not p.running and loop.ready == []


# -- the setting ------------------------------------------------------------------------------


def config(**flags: Any) -> Any:
    return build_config(flags={"upstream": "http://127.0.0.1:9", **flags}, env={}, file=None)


def test_setting_is_off_by_default_set_from_env_and_refused_out_of_range() -> None:
    assert config().idle_poll_us == 0  # opt-in: the default never polls
    cfg = build_config(flags={"upstream": "http://127.0.0.1:9"}, env={"SIDECAR_IDLE_POLL_US": "200"}, file=None)
    assert cfg.idle_poll_us == 200
    for bad in ("-1", "10001", "soon"):
        with pytest.raises(ConfigError, match="idle_poll_us"):
            build_config(flags={"upstream": "http://127.0.0.1:9"}, env={"SIDECAR_IDLE_POLL_US": bad}, file=None)


@pytest.mark.parametrize(
    ("v2", "v1", "cpus"),
    [
        (None, None, None),  # no cgroup files: no quota
        ("max 100000\n", None, None),
        ("100000 100000\n", None, 1.0),
        ("50000 100000\n", None, 0.5),
        (None, ("-1", "100000"), None),
        (None, ("25000", "100000"), 0.25),
        (None, ("400000", "100000"), 4.0),
    ],
)
def test_cpu_quota_from_cgroup_v2_or_v1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, v2: str | None, v1: tuple[str, str] | None, cpus: float | None
) -> None:
    use_quota(monkeypatch, tmp_path, v2, v1)
    assert cpu_quota() == cpus


def use_quota(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, v2: str | None, v1: tuple[str, str] | None = None
) -> None:
    """Make the cgroup files say ``v2`` (cpu.max) and ``v1`` (quota, period); None: absent."""
    cpu_max, quota, period = tmp_path / "cpu.max", tmp_path / "quota", tmp_path / "period"
    if v2 is not None:
        cpu_max.write_text(v2)
    if v1 is not None:
        quota.write_text(v1[0])
        period.write_text(v1[1])
    monkeypatch.setattr(idle_poll, "_CPU_MAX", cpu_max)
    monkeypatch.setattr(idle_poll, "_CFS_QUOTA", quota)
    monkeypatch.setattr(idle_poll, "_CFS_PERIOD", period)


# -- on the wire ------------------------------------------------------------------------------


async def polled_seconds(sc: Any) -> float:
    async with aiohttp.ClientSession() as s, s.get(f"{sc.admin_url}/metrics") as r:
        text = await r.text()
    values = [line.split()[-1] for line in text.splitlines() if line.startswith("sidecar_idle_poll_seconds_total ")]
    assert len(values) == 1, text
    return float(values[0])


async def proxied_burst(start_sidecar: StartSidecar, upstream: RecordingUpstream, idle_poll_us: int | None) -> Any:
    """A sidecar with ``idle_poll_us`` (None: unset) that proxied 30 requests in a row, each one checked."""
    sc = await start_sidecar(
        upstream=upstream.url, mode="dynamo_headers", **({} if idle_poll_us is None else {"idle_poll_us": idle_poll_us})
    )
    async with aiohttp.ClientSession() as s:
        for i in range(30):
            async with s.post(
                f"{sc.proxy_url}/v1/chat/completions",
                json={"model": "m", "messages": [], "i": i},
                headers={"X-Correlation-ID": "conv-poll"},
            ) as r:
                assert r.status == 200
                await r.read()
    assert [r.json()["i"] for r in upstream.received] == list(range(30))  # type: ignore[index]
    assert all(r.header("X-Dynamo-Session-ID") == "conv-poll" for r in upstream.received)
    return sc


@pytest.mark.parametrize("engine", ["fast"])
async def test_engine_polls_during_traffic_then_sleeps(
    start_sidecar: StartSidecar, upstream: RecordingUpstream
) -> None:
    # The longest window: on any machine a local round trip keeps events closer than 10 ms.
    sc = await proxied_burst(start_sidecar, upstream, 10_000)
    poller = sc.engine.shared.poller
    await asyncio.sleep(0.05)  # no event for 5 windows: polling stopped, the loop sleeps
    assert not poller.running
    polled = await polled_seconds(sc)
    assert polled > 0
    await asyncio.sleep(0.05)
    assert await polled_seconds(sc) == polled  # nothing polled while idle
    await sc.stop()
    assert poller.stopped


@pytest.mark.parametrize("engine", ["fast"])
async def test_engine_polls_only_when_opted_in_and_warns_under_a_small_cpu_quota(
    start_sidecar: StartSidecar,
    upstream: RecordingUpstream,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    use_quota(monkeypatch, tmp_path, "50000 100000\n")
    with caplog.at_level(logging.INFO, logger="sidecar.engine"):
        sc = await proxied_burst(start_sidecar, upstream, 10_000)
    warnings = [r for r in caplog.records if "idle_poll_us" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "quota" in warnings[0].getMessage() and "throttled" in warnings[0].getMessage()
    assert await polled_seconds(sc) > 0  # opted in: it polls all the same


@pytest.mark.parametrize("engine", ["fast"])
async def test_engine_by_default_never_polls_nor_warns(
    start_sidecar: StartSidecar,
    upstream: RecordingUpstream,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    use_quota(monkeypatch, tmp_path, "50000 100000\n")
    with caplog.at_level(logging.INFO, logger="sidecar.engine"):
        sc = await proxied_burst(start_sidecar, upstream, None)
    assert sc.engine.shared.poller.window == 0
    assert await polled_seconds(sc) == 0.0
    assert not [r for r in caplog.records if "idle_poll_us" in r.getMessage()]


@pytest.mark.parametrize("engine", ["fast"])
async def test_engine_with_polling_set_off_never_polls(
    start_sidecar: StartSidecar, upstream: RecordingUpstream
) -> None:
    sc = await proxied_burst(start_sidecar, upstream, 0)
    assert await polled_seconds(sc) == 0.0
