"""End of session on every terminal path: exactly once, with the reason, after the last proxied byte.

The proxy-level paths run through a real sidecar on loopback; expiry and eviction drive the
router with an injectable clock (no sleeps).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import aiohttp
import pytest

from sidecar.config import build_config
from sidecar.context import TurnOutcome
from sidecar.metrics import Metrics
from sidecar.modes.base import EndAction, SessionEnd
from sidecar.modes.dynamo import DynamoHeaders
from sidecar.router import RequestHead, Router
from sidecar.wiring import routing_core
from tests.proxy.test_errors import free_port
from tests.waiting import LoopLag, wait_for


class Recording(DynamoHeaders):
    """dynamo_headers that records each end-of-session call with the time it ran."""

    def __init__(self, options, *, fail_for: str | None = None) -> None:
        super().__init__(options)
        self.ends: list[tuple[str, str, float]] = []
        self.fail_for = fail_for

    def on_session_end(self, end: SessionEnd) -> Sequence[EndAction]:
        self.ends.append((end.session, end.reason, time.monotonic()))
        if end.session == self.fail_for:
            raise RuntimeError("hook failure")
        return ()


def record(sc) -> Recording:
    dep = sc.router.default
    rec = Recording(dep.mode.options)
    dep.mode = rec
    return rec


FINAL = {"X-Session-Final": "true"}


async def test_final_turn_completed_after_last_byte(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    rec = record(sc)
    async with aiohttp.ClientSession() as s, LoopLag() as lag:
        async with s.get(f"{sc.proxy_url}/x", headers={"X-Correlation-ID": "s1"}) as resp:
            await resp.read()
        async with s.get(f"{sc.proxy_url}/sse?chunks=3&gap=0.1", headers={"X-Correlation-ID": "s1", **FINAL}) as resp:
            await resp.content.readuntil(b'{"i":2}\n\n')
            # The stream is not over (the [DONE] event is still to come): the session has not ended.
            assert rec.ends == []
            rest = await resp.read()
            got_all = time.monotonic()
        assert rest == b"data: [DONE]\n\n"
        await wait_for(lambda: rec.ends)
    await asyncio.sleep(0.05)
    [(session, reason, at)] = rec.ends
    assert (session, reason) == ("s1", "final_turn_completed")
    assert at > upstream.sse_sent_at[-1]
    assert at <= got_all + 0.05 + lag.worst  # (what a busy machine delayed the loop by is not the sidecar's)


async def test_final_turn_failed_upstream(start_sidecar):
    sc = await start_sidecar(upstream=f"http://127.0.0.1:{free_port()}", mode="dynamo_headers")
    rec = record(sc)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.proxy_url}/x", headers={"X-Correlation-ID": "s2", **FINAL}) as resp:
            assert resp.status == 502
            await resp.read()
    await wait_for(lambda: rec.ends)
    assert [(e[0], e[1]) for e in rec.ends] == [("s2", "final_turn_failed")]


async def test_final_turn_5xx_counts_as_failed(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    rec = record(sc)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.proxy_url}/status/503", headers={"X-Correlation-ID": "s5", **FINAL}) as resp:
            await resp.read()
    await wait_for(lambda: rec.ends)
    assert [(e[0], e[1]) for e in rec.ends] == [("s5", "final_turn_failed")]


async def test_client_abandoned_final_turn(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    rec = record(sc)
    reader, writer = await asyncio.open_connection("127.0.0.1", int(sc.proxy_url.rsplit(":", 1)[1]))
    writer.write(
        b"GET /sse?chunks=40&gap=0.05 HTTP/1.1\r\nHost: x\r\nX-Correlation-ID: s3\r\nX-Session-Final: true\r\n\r\n"
    )
    await reader.readuntil(b'{"i":0}\n\n')
    assert rec.ends == []
    writer.close()
    await wait_for(lambda: rec.ends)
    await asyncio.sleep(0.1)  # a second end would show up here
    assert [(e[0], e[1]) for e in rec.ends] == [("s3", "client_abandoned")]


async def test_api_close_waits_for_in_flight_stream(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    rec = record(sc)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.proxy_url}/sse?chunks=3&gap=0.1", headers={"X-Correlation-ID": "s4"}) as resp:
            await resp.content.readuntil(b"\n\n")
            sc.router.close_session("s4")
            assert rec.ends == []  # still streaming: ends after the last byte
            await resp.read()
    await wait_for(lambda: rec.ends)
    await asyncio.sleep(0.05)
    assert [(e[0], e[1]) for e in rec.ends] == [("s4", "api_closed")]
    assert sc.router.tree.is_closed("s4")


async def test_shutdown_sweep_ends_live_sessions_once(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    rec = record(sc)
    async with aiohttp.ClientSession() as s:
        for sid in ("a", "b", "a"):
            async with s.get(f"{sc.proxy_url}/x", headers={"X-Correlation-ID": sid}) as resp:
                await resp.read()
    await sc.stop()
    await sc.stop()
    assert sorted((e[0], e[1]) for e in rec.ends) == [("a", "shutdown"), ("b", "shutdown")]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_router(clock: Clock, **sessions: object) -> tuple[Router, Recording, Metrics]:
    cfg = build_config(flags={"upstream": "http://127.0.0.1:9", "mode": "dynamo_headers"}, env={})
    cfg = cfg.model_copy(update={"sessions": cfg.sessions.model_copy(update=sessions)})
    metrics = Metrics()
    router = routing_core(cfg, metrics, tree_clock=clock)
    rec = Recording(router.default.mode.options, fail_for="boom")
    router.default.mode = rec
    return router, rec, metrics


def turn(router: Router, sid: str, final: bool = False) -> None:
    headers = {"x-correlation-id": sid}
    if final:
        headers["x-session-final"] = "true"
    router.admit(RequestHead("POST", headers)).finish(TurnOutcome.COMPLETED)


def test_idle_expiry_with_injectable_clock():
    clock = Clock()
    router, rec, metrics = make_router(clock, idle_ttl_seconds=60)
    turn(router, "old")
    clock.now += 30
    turn(router, "young")
    clock.now += 31
    router.expire()
    assert [(e[0], e[1]) for e in rec.ends] == [("old", "idle_expired")]
    clock.now += 30
    router.expire()
    router.expire()
    assert [(e[0], e[1]) for e in rec.ends] == [("old", "idle_expired"), ("young", "idle_expired")]
    assert (
        metrics.registry.get_sample_value(
            "sidecar_sessions_ended_total", {"deployment": "default", "reason": "idle_expired"}
        )
        == 2
    )


def test_eviction_at_cap_least_recently_active_first_and_hook_failure_does_not_stop_it():
    clock = Clock()
    router, rec, metrics = make_router(clock, max_live_sessions=3)
    for sid in ("boom", "s2", "s3"):
        turn(router, sid)
        clock.now += 1
    turn(router, "boom")  # now the most recently active; s2 is the least
    clock.now += 1
    turn(router, "s4")
    assert [(e[0], e[1]) for e in rec.ends] == [("s2", "evicted")]
    turn(router, "s5")
    turn(router, "s6")
    # The failing hook of "boom" is counted; the next eviction still happened.
    assert [(e[0], e[1]) for e in rec.ends] == [("s2", "evicted"), ("s3", "evicted"), ("boom", "evicted")]
    assert (
        metrics.registry.get_sample_value(
            "sidecar_plugin_errors_total", {"mode": "dynamo_headers", "hook": "on_session_end"}
        )
        == 1
    )
    assert metrics.registry.get_sample_value("sidecar_session_evictions_total") == 3
    assert router.tree.live_sessions == 3


def test_tombstoned_id_returning_is_a_new_session_and_counted():
    clock = Clock()
    router, rec, metrics = make_router(clock)
    turn(router, "t", final=True)
    assert [(e[0], e[1]) for e in rec.ends] == [("t", "final_turn_completed")]
    turn(router, "t")
    assert router.tree.get("t")["turns"] == 1
    assert metrics.registry.get_sample_value("sidecar_tombstone_reuses_total") == 1


@pytest.mark.parametrize(
    "outcome,reason",
    [(TurnOutcome.UPSTREAM_FAILED, "final_turn_failed"), (TurnOutcome.CLIENT_ABORTED, "client_abandoned")],
)
def test_finish_is_idempotent_and_ends_once(outcome, reason):
    router, rec, _ = make_router(Clock())
    adm = router.admit(RequestHead("GET", {"x-correlation-id": "z", "x-session-final": "true"}))
    adm.finish(outcome)
    adm.finish(TurnOutcome.COMPLETED)
    assert [(e[0], e[1]) for e in rec.ends] == [("z", reason)]
