"""Idle polling: the event loop polls instead of sleeping while I/O events come close together.

An event loop with nothing to run blocks in ``epoll_wait`` and its CPU goes idle. Waking it for
the next event costs an interrupt (on a virtual machine, an exit to the hypervisor and back) and
caches refilled after whatever ran meanwhile: tens of microseconds, at one request in flight
more than the request's own work. While events arrive less than ``window`` apart, the
:class:`IdlePoller` keeps one callback scheduled, so the loop polls with a zero timeout instead
of blocking; once ``window`` passes without an event, it stops and the loop sleeps again.

Like a network driver switching from interrupts to polling under load (NAPI), it polls only
while the sidecar is busy: an event that comes more than ``window`` after the previous one does
not start it, and a :data:`PERIOD` of polling in which less than :data:`MIN_BUSY` of the time went
to work stops it for :data:`COOLDOWN`. So a sidecar serving sparse traffic seldom polls, and
polling at most quadruples the CPU time the sidecar spends anyway.

It is opt-in: ``window`` is the ``idle_poll_us`` setting, 0 (never poll) unless set. Polling buys
about a tenth of a millisecond per request at one connection and costs CPU (up to about twice at
moderate request rates, and on token streams about half as much again per relayed event); in a
container allowed less than one CPU (:func:`cpu_quota`) it spends the quota and the throttled
container then stalls until the next period, which the engine warns about at start.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from time import perf_counter

# Polling pays for itself only while the loop has work: every PERIOD of polling, if less than
# MIN_BUSY of it went to reads (and what they ran), polling stops for COOLDOWN. So it at most
# quadruples the sidecar's CPU, and only once the sidecar is busy a quarter of the time.
PERIOD = 0.005
MIN_BUSY = 0.25
COOLDOWN = 0.05

# Where cgroup v2 and v1 publish the container's CPU quota.
_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
_CFS_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
_CFS_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


class IdlePoller:
    """Keeps ``loop`` polling for up to ``window`` seconds after an I/O event, while events arrive
    less than ``window`` apart and the loop spends at least :data:`MIN_BUSY` of its polling time
    on work. The engine calls :meth:`note` on every read; ``window`` 0 never polls."""

    __slots__ = (
        "loop",
        "window",
        "last",
        "running",
        "stopped",
        "busy_from",
        "busy",
        "polled",
        "since",
        "resume_at",
        "total",
        "_tick_cb",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, window: float) -> None:
        self.loop = loop
        self.window = window
        self.last = -math.inf  # perf_counter time of the latest event the poller knows of
        self.running = False
        self.stopped = window <= 0
        self.busy_from = 0.0  # while running: when the first read of this loop iteration came, or 0
        self.busy = 0.0  # time spent on reads (and what they ran) while polling, this period
        self.polled = 0.0  # time spent polling this period, before the current run
        self.since = 0.0  # when the current run began
        self.resume_at = -math.inf  # after a period with too little work: no polling before this
        self.total = 0.0  # time spent polling in finished periods and runs (see polled_seconds)
        self._tick_cb = self._tick  # bound once: the tick reschedules itself every loop iteration

    def note(self) -> None:
        """An I/O event arrived."""
        if self.running:
            if not self.busy_from:
                self.busy_from = perf_counter()
        elif not self.stopped:
            now = perf_counter()
            if now - self.last < self.window and now >= self.resume_at:  # two events in a row, close
                self.running = True
                self.since = self.busy_from = now
                self.loop.call_soon(self._tick_cb)
            self.last = now

    def stop(self) -> None:
        """Never poll again (the engine is closing)."""
        self.stopped = True

    def polled_seconds(self) -> float:
        """Time the loop has spent polling so far (busy time included)."""
        return self.total + self.polled + (perf_counter() - self.since if self.running else 0.0)

    def _tick(self) -> None:
        now = perf_counter()
        if self.busy_from:  # reads ran since the last tick: they took until now
            self.busy += now - self.busy_from
            self.busy_from = 0.0
            self.last = now
        polled = self.polled + now - self.since
        if polled >= PERIOD:  # a period ends: poll on only if the loop had enough work in it
            idle = self.busy < MIN_BUSY * polled
            self.total += polled
            self.busy = self.polled = 0.0
            self.since = now
            if idle:
                self.running = False
                self.resume_at = now + COOLDOWN
                return
        if self.stopped or now - self.last >= self.window:
            self.running = False  # the loop may sleep; the next close pair of events restarts it
            self.polled += now - self.since
            return
        self.loop.call_soon(self._tick_cb)


def cpu_quota() -> float | None:
    """The CPUs this container may use per period (cgroup v2 or v1), or None without a quota."""
    try:
        quota, period = _CPU_MAX.read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(_CFS_QUOTA.read_text())
        return None if quota_us < 0 else quota_us / int(_CFS_PERIOD.read_text())
    except (OSError, ValueError):
        return None
