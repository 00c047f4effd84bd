"""The balancer on hand-built upstreams: ranking, failover, thresholds, bounded overrides."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.balancer import PASSIVE_RETRY_SECONDS, Balancer
from sidecar.config import HealthCheckConfig


@dataclass(frozen=True)
class U:
    url: str


UPS = [U(f"http://10.0.0.{i}:8000") for i in range(4)]


def test_rendezvous_removing_one_moves_only_its_keys():
    full = Balancer("d", UPS)
    less = Balancer("d", UPS[:3])
    keys = [f"k{i}" for i in range(400)]
    moved = [k for k in keys if full.pick(k) is not less.pick(k)]
    assert all(full.pick(k) is UPS[3] for k in moved)
    assert {full.pick(k) for k in keys} == set(UPS)


def test_thresholds_and_failover_to_next_ranked():
    hc = HealthCheckConfig(unhealthy_threshold=2, healthy_threshold=3)
    b = Balancer("d", UPS, health_check=hc)
    key = "tree"
    first, second = b.rank(key)[:2]
    b.report(first, False)
    assert b.pick(key) is first  # one failure is below the threshold
    b.report(first, False)
    assert b.pick(key) is second and b.overrides == 1 and b.failovers == 1
    for _ in range(2):
        b.report(first, True)
    assert not b.is_healthy(first)
    b.report(first, True)
    assert b.is_healthy(first) and b.pick(key) is second  # no failback: stays moved
    b.forget(key)
    assert b.pick(key) is first


def test_failback_returns_and_keeps_no_state():
    b = Balancer("d", UPS, failback=True, health_check=HealthCheckConfig())
    first, second = b.rank("t")[:2]
    b.report(first, False)
    assert b.pick("t") is second and b.overrides == 0
    b.report(first, True)
    assert b.pick("t") is first


def test_passive_mark_retried_after_cooldown_without_checks():
    now = [0.0]
    b = Balancer("d", UPS, clock=lambda: now[0])
    first = b.rank("t")[0]
    b.mark_unreachable(first)
    assert b.pick("t") is not first
    now[0] += PASSIVE_RETRY_SECONDS
    assert b.is_healthy(first)


def test_overrides_are_bounded_and_all_down_tries_first_choice():
    b = Balancer("d", UPS, health_check=HealthCheckConfig(), max_overrides=5)
    b.report(UPS[0], False)
    keys = [k for k in (f"k{i}" for i in range(200)) if b.rank(k)[0] is UPS[0]]
    for k in keys:
        b.pick(k)
    assert b.overrides == 5
    for u in UPS:
        b.report(u, False)
    assert b.pick("zzz") is b.rank("zzz")[0]


def test_single_upstream_ignores_health():
    b = Balancer("d", UPS[:1], health_check=HealthCheckConfig())
    b.report(UPS[0], False)
    b.mark_unreachable(UPS[0])
    assert b.pick("t") is UPS[0] and b.pick(None) is UPS[0]
