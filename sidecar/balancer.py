"""Which of a deployment's upstream replicas serves a session tree. Synchronous, no I/O.

Each tree goes to the upstream ranked first for its root id by rendezvous (highest random
weight) hashing: every sidecar replica computes the same ranking without shared state, and
removing an upstream moves only the trees it served. When that upstream is unhealthy, the tree
fails over to the next-ranked healthy one. With ``failback`` off (the default) the tree stays
there even after its first choice recovers (its KV cache now lives on the new worker): the
override is remembered per root in a bounded map and dropped when the tree ends
(:meth:`Balancer.forget`). With ``failback`` on, the ranking alone decides, so a recovered
upstream gets its trees back.

Health comes from two sources, fed by the app and the engines: active checks
(:meth:`Balancer.report`, counting consecutive results against the thresholds) and passive
marking when connecting failed (:meth:`Balancer.mark_unreachable`). Without active checks a
passively marked upstream is tried again after ``PASSIVE_RETRY_SECONDS``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from sidecar.config import HealthCheckConfig

log = logging.getLogger("sidecar.balancer")

PASSIVE_RETRY_SECONDS = 5.0


class _HasURL(Protocol):
    @property
    def url(self) -> str: ...


U = TypeVar("U", bound=_HasURL)


class _State:
    __slots__ = ("healthy", "successes", "failures", "retry_at")

    def __init__(self) -> None:
        self.healthy = True
        self.successes = 0
        self.failures = 0
        self.retry_at = 0.0


class Balancer(Generic[U]):
    """Upstream choice per tree root for one deployment. See the module docstring."""

    def __init__(
        self,
        deployment: str,
        upstreams: Sequence[U],
        *,
        failback: bool = False,
        health_check: HealthCheckConfig | None = None,
        max_overrides: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.deployment = deployment
        self.upstreams = tuple(upstreams)
        self.failback = failback
        self.health_check = health_check
        self.max_overrides = max_overrides
        self._clock = clock
        self._state = {u.url: _State() for u in self.upstreams}
        self._overrides: OrderedDict[str, U] = OrderedDict()
        self.failovers = 0

    def rank(self, root: str) -> list[U]:
        """The upstreams in preference order for ``root``."""
        return sorted(self.upstreams, key=lambda u: _weight(u.url, root), reverse=True)

    def pick(self, root: str | None) -> U:
        """The upstream for a request of the tree ``root`` (None: a request without a session)."""
        ups = self.upstreams
        if len(ups) == 1:
            return ups[0]
        if root is None:
            return next((u for u in ups if self.is_healthy(u)), ups[0])
        override = self._overrides.get(root)
        if override is not None:
            if self.is_healthy(override):
                self._overrides.move_to_end(root)
                return override
            del self._overrides[root]
        ranked = self.rank(root)
        chosen = next((u for u in ranked if self.is_healthy(u)), None)
        if chosen is None:  # nothing known healthy: try the first choice rather than fail here
            return ranked[0]
        if chosen is not ranked[0]:
            self.failovers += 1
            if not self.failback:
                self._overrides[root] = chosen
                if len(self._overrides) > self.max_overrides:
                    self._overrides.popitem(last=False)
        return chosen

    def forget(self, root: str) -> None:
        """The tree ``root`` ended: drop its override."""
        self._overrides.pop(root, None)

    @property
    def overrides(self) -> int:
        return len(self._overrides)

    # -- health ------------------------------------------------------------------------------

    def is_healthy(self, upstream: U) -> bool:
        st = self._state[upstream.url]
        if st.healthy:
            return True
        return self.health_check is None and self._clock() >= st.retry_at

    def report(self, upstream: U, ok: bool) -> None:
        """One active health-check result."""
        st = self._state[upstream.url]
        hc = self.health_check
        assert hc is not None
        if ok:
            st.failures = 0
            st.successes += 1
            if not st.healthy and st.successes >= hc.healthy_threshold:
                st.healthy = True
                log.info("upstream healthy again", extra={"deployment": self.deployment, "upstream": upstream.url})
        else:
            st.successes = 0
            st.failures += 1
            if st.healthy and st.failures >= hc.unhealthy_threshold:
                self._down(upstream, st, "health check failed")

    def mark_unreachable(self, upstream: U) -> None:
        """Connecting to ``upstream`` failed while proxying a request."""
        st = self._state.get(upstream.url)
        if st is None or len(self.upstreams) == 1:
            return
        st.successes = 0
        st.retry_at = self._clock() + PASSIVE_RETRY_SECONDS
        if st.healthy:
            self._down(upstream, st, "connect failed")

    def _down(self, upstream: U, st: _State, why: str) -> None:
        st.healthy = False
        log.warning("upstream unhealthy: %s", why, extra={"deployment": self.deployment, "upstream": upstream.url})


def _weight(url: str, key: str) -> bytes:
    return hashlib.blake2b(f"{url}\x00{key}".encode(), digest_size=8).digest()
