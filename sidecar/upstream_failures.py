"""WARNING lines for failed upstream exchanges, rate-limited so an outage cannot flood the log.

Both engines call :meth:`UpstreamFailureLog.record` where a request fails on the upstream side
(connect refused, TLS handshake, timeout, reset, invalid response). Failures are grouped by
(deployment, upstream, kind, reason): the first of a group is logged at once; the ones that follow
within ``interval`` seconds are only counted, and one line at the end of that interval carries
the count (``suppressed``). So a dead upstream costs at most one line per interval per reason.

A line names the deployment, the upstream (its URL without credentials, and its index), the
kind (the ``kind`` label of ``sidecar_upstream_errors_total``) and a short reason; never a
request's headers or body. State is bounded: at most ``max_groups`` groups are remembered (the
least recently failing one is flushed and forgotten first), with at most one timer each.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Protocol

log = logging.getLogger("sidecar.upstream")

INTERVAL_SECONDS = 10.0
MAX_GROUPS = 256


class _Upstream(Protocol):
    @property
    def display(self) -> str: ...

    @property
    def index(self) -> int: ...


class _Group:
    __slots__ = ("deployment", "upstream", "index", "kind", "reason", "suppressed", "timer")

    def __init__(self, deployment: str, upstream: str, index: int, kind: str, reason: str) -> None:
        self.deployment = deployment
        self.upstream = upstream
        self.index = index
        self.kind = kind
        self.reason = reason
        self.suppressed = 0  # failures counted since the last line
        self.timer: asyncio.TimerHandle | None = None  # the end of the current interval


class UpstreamFailureLog:
    """Rate-limited upstream failure lines (see the module docstring). Runs on the event loop."""

    def __init__(
        self, *, interval: float = INTERVAL_SECONDS, max_groups: int = MAX_GROUPS, logger: logging.Logger = log
    ) -> None:
        self.interval = interval
        self.max_groups = max_groups
        self._log = logger
        # group key -> group, least recently failing first; a group lives while its interval runs.
        self._groups: OrderedDict[tuple[str, str, int, str, str], _Group] = OrderedDict()

    def record(self, deployment: str, upstream: _Upstream, kind: str, reason: str) -> None:
        """One failed exchange with ``upstream`` of ``deployment``. ``reason`` must be client-safe
        and from a small set (:func:`sidecar.errors.failure_reason`): it is part of the group."""
        display = upstream.display
        key = (deployment, display, upstream.index, kind, reason)
        group = self._groups.get(key)
        if group is not None:
            group.suppressed += 1
            self._groups.move_to_end(key)
            return
        group = self._groups[key] = _Group(deployment, display, upstream.index, kind, reason)
        self._emit(group)
        group.timer = asyncio.get_running_loop().call_later(self.interval, self._interval_over, key)
        if len(self._groups) > self.max_groups:
            _, oldest = self._groups.popitem(last=False)
            self._retire(oldest)

    def close(self) -> None:
        """Log what is still counted and cancel the timers (at shutdown)."""
        while self._groups:
            _, group = self._groups.popitem(last=False)
            self._retire(group)

    @property
    def groups(self) -> int:
        return len(self._groups)

    def _interval_over(self, key: tuple[str, str, int, str, str]) -> None:
        group = self._groups.get(key)
        if group is None:
            return
        if not group.suppressed:  # quiet for a whole interval: the next failure is logged at once
            del self._groups[key]
            return
        self._emit(group)
        group.suppressed = 0
        group.timer = asyncio.get_running_loop().call_later(self.interval, self._interval_over, key)

    def _retire(self, group: _Group) -> None:
        if group.timer is not None:
            group.timer.cancel()
            group.timer = None
        if group.suppressed:
            self._emit(group)

    def _emit(self, group: _Group) -> None:
        extra: dict[str, object] = {
            "deployment": group.deployment,
            "upstream": group.upstream,
            "upstream_index": group.index,
            "kind": group.kind,
            "reason": group.reason,
        }
        if group.suppressed:
            extra["suppressed"] = group.suppressed
            self._log.warning(
                "upstream failed: %s (%d more like it in the last %g s)",
                group.reason,
                group.suppressed,
                self.interval,
                extra=extra,
            )
        else:
            self._log.warning("upstream failed: %s", group.reason, extra=extra)
