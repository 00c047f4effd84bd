"""Proof that affinity holds: the worker of every turn, outcomes, history and the moved log line."""

from __future__ import annotations

import logging

import aiohttp


async def turns(sc, session: str, workers: list[str], *, path: str = "/worker") -> None:
    async with aiohttp.ClientSession() as s:
        for w in workers:
            async with s.get(f"{sc.proxy_url}{path}?w={w}", headers={"X-Correlation-ID": session}) as resp:
                assert resp.status == 200
                await resp.read()


def sample(sc, outcome: str) -> float | None:
    return sc.metrics.registry.get_sample_value(
        "sidecar_affinity_turns_total", {"deployment": "default", "outcome": outcome}
    )


async def test_turn_outcomes_history_and_moved_log(upstream, start_sidecar, caplog):
    sc = await start_sidecar(upstream=upstream.url, mode="smg_routing_key")
    caplog.set_level(logging.INFO, logger="sidecar.router")
    await turns(sc, "sess-1", ["http://w1:1", "http://w1:1", "http://w2:2", "http://w2:2"])
    await turns(sc, "sess-2", ["http://w2:2"])
    assert (sample(sc, "first"), sample(sc, "same_worker"), sample(sc, "moved")) == (2, 2, 1)
    node = sc.router.tree.get("sess-1")
    assert node["workers"] == [{"worker": "http://w1:1", "turns": 2}, {"worker": "http://w2:2", "turns": 2}]
    assert node["affinity"] == {"first": 1, "same_worker": 2, "moved": 1}
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.admin_url}/v1/trees/sess-1") as resp:
            tree = await resp.json()
        async with s.get(f"{sc.admin_url}/v1/sessions/sess-1") as resp:
            resource = await resp.json()
    assert tree["workers"][-1] == {"worker": "http://w2:2", "turns": 2} and tree["affinity"]["moved"] == 1
    assert resource["workers"] == node["workers"] and resource["affinity"] == node["affinity"]
    [moved] = [r for r in caplog.records if getattr(r, "event", None) == "moved"]
    assert (moved.from_worker, moved.to_worker, moved.turn) == ("http://w1:1", "http://w2:2", 3)
    # Session ids are logged only at debug level.
    assert not hasattr(moved, "session")


async def test_moved_log_names_the_session_at_debug_level(upstream, start_sidecar, caplog):
    sc = await start_sidecar(upstream=upstream.url, mode="smg_routing_key")
    caplog.set_level(logging.INFO, logger="sidecar.router")
    await turns(sc, "sess-i", ["a", "b"])
    # The level changes while the sidecar runs: the router's debug check follows it.
    caplog.set_level(logging.DEBUG, logger="sidecar.router")
    await turns(sc, "sess-d", ["a", "b"])
    first, moved = [r for r in caplog.records if getattr(r, "event", None) == "moved"]
    assert not hasattr(first, "session")
    assert (moved.session, moved.from_worker, moved.to_worker) == ("sess-d", "a", "b")
    assert any(getattr(r, "event", None) == "request" and r.session == "sess-d" for r in caplog.records)
    caplog.set_level(logging.INFO, logger="sidecar.router")
    caplog.clear()
    await turns(sc, "sess-j", ["a", "b"])
    [again] = [r for r in caplog.records if getattr(r, "event", None) == "moved"]
    assert not hasattr(again, "session") and not any(getattr(r, "event", None) == "request" for r in caplog.records)


async def test_worker_header_is_configurable(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers", affinity={"worker_headers": ["X-Worker-Id"]})
    await turns(sc, "s", ["x", "y"])
    assert sc.router.tree.get("s")["workers"] == [{"worker": "x", "turns": 1}, {"worker": "y", "turns": 1}]
    assert sample(sc, "moved") == 1


async def test_no_worker_header_records_nothing(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    await turns(sc, "s", ["x"], path="/plain")
    assert sc.router.tree.get("s")["workers"] == []
    assert sample(sc, "first") is None


async def test_llmd_session_token_is_remembered_and_echoed(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="llmd_session_token")
    async with aiohttp.ClientSession() as s:
        for i, query in enumerate(["token=tok-1", "", "token=tok-2", ""]):
            async with s.get(
                f"{sc.proxy_url}/llmd?{query}", headers={"X-Correlation-ID": "conv", "x-session-token": f"client-{i}"}
            ) as resp:
                assert resp.status == 200
        async with s.get(f"{sc.proxy_url}/llmd", headers={"X-Correlation-ID": "other"}) as resp:
            assert resp.status == 200
    sent = [r.all("x-session-token") for r in upstream.received]
    # First turn: no token yet (the client's copy is not trusted); then the latest one the picker gave.
    assert sent == [[], ["tok-1"], ["tok-1"], ["tok-2"], []]


async def test_llmd_token_is_dropped_with_the_session(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="llmd_session_token")
    async with aiohttp.ClientSession() as s:
        async with s.get(
            f"{sc.proxy_url}/llmd?token=t1", headers={"X-Correlation-ID": "c", "X-Session-Final": "true"}
        ) as resp:
            await resp.read()
        async with s.get(f"{sc.proxy_url}/llmd", headers={"X-Correlation-ID": "c"}) as resp:
            await resp.read()
    # The second request is a new session (the first ended): no stale token is echoed.
    assert [r.all("x-session-token") for r in upstream.received] == [[], []]


async def test_a_worker_id_longer_than_256_bytes_is_kept_and_logged_fitted(upstream, start_sidecar, caplog):
    # The worker id comes from the upstream's header and stays in the tree per session: an
    # upstream sending long ones must not grow the tree (or the moved log lines) with them.
    sc = await start_sidecar(upstream=upstream.url, mode="smg_routing_key")
    caplog.set_level(logging.INFO, logger="sidecar.router")
    long_a, long_b = "a" * 5_000, "b" * 300
    await turns(sc, "sess-long", [long_a, long_a, long_b, "w-short"])
    workers = [run["worker"] for run in sc.router.tree.get("sess-long")["workers"]]
    assert [len(w.encode()) for w in workers] == [256, 256, len("w-short")]
    assert workers[0].startswith("a" * 200) and workers[0] != workers[1] and workers[1].startswith("b" * 200)
    assert sc.router.tree.get("sess-long")["workers"][0]["turns"] == 2  # one fitted id per worker
    moved = [r for r in caplog.records if getattr(r, "event", None) == "moved"]
    assert [(r.from_worker, r.to_worker) for r in moved] == [(workers[0], workers[1]), (workers[1], "w-short")]
