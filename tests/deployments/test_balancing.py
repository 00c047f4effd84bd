"""Session-aware balancing across upstream replicas: one upstream per tree, failover of only
the dead replica's trees, failback on or off, health checks active and passive."""

from __future__ import annotations

import asyncio
import socket
from collections import defaultdict

import aiohttp
import pytest
from aiohttp import web

from tests.waiting import wait_for

TREES = 60
CHILDREN = 2


class Replica:
    """One upstream replica that can be killed and brought back on the same port. While dead
    its port stays bound (not listening: connections are refused), so that no other server
    on the machine takes it meanwhile and answers its health checks."""

    def __init__(self, index: int, served: dict[str, list[int]]) -> None:
        self.index = index
        self.served = served  # X-Correlation-ID -> replicas that answered it, in order
        self.port = 0
        self.runner: web.AppRunner | None = None
        self._held: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.Response:
        if request.path == "/health":
            return web.json_response({"ok": True})
        self.served[request.headers.get("X-Correlation-ID", "")].append(self.index)
        return web.json_response({"replica": self.index})

    async def start(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()
        self.runner = None
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", self.port))
        self._held = held


def sessions_of(tree: str) -> list[tuple[str, str | None]]:
    return [(tree, None)] + [(f"{tree}.c{j}", tree) for j in range(CHILDREN)]


async def send(http: aiohttp.ClientSession, proxy: str, session: str, parent: str | None) -> int:
    headers = {"X-Correlation-ID": session}
    if parent:
        headers["X-Parent-Session-ID"] = parent
    try:
        async with http.post(proxy + "/v1/chat/completions", data=b"{}", headers=headers) as resp:
            await resp.read()
            return resp.status
    except aiohttp.ClientError:
        return 0


async def run_round(http, proxy: str, trees: list[str], served: dict[str, list[int]]) -> dict[str, set[int]]:
    """Every session of every tree once; returns the replicas that served each tree this round."""
    before = {s: len(served[s]) for t in trees for s, _ in sessions_of(t)}

    async def tree_requests(tree: str) -> list[int]:
        return [await send(http, proxy, s, p) for s, p in sessions_of(tree)]

    statuses = await asyncio.gather(*(tree_requests(t) for t in trees))
    assert all(code == 200 for codes in statuses for code in codes), statuses
    return {t: {r for s, _ in sessions_of(t) for r in served[s][before[s] :]} for t in trees}


@pytest.fixture
async def replicas():
    served: dict[str, list[int]] = defaultdict(list)
    reps = [Replica(i, served) for i in range(3)]
    for r in reps:
        await r.start()
    yield reps, served
    for r in reps:
        if r.runner is not None:
            await r.stop()
        if r._held is not None:
            r._held.close()


def pool(reps, **keys) -> list[dict]:
    return [{"name": "pool", "upstreams": [r.url for r in reps], **keys}]


HEALTH = {"path": "/health", "interval_seconds": 0.05, "timeout_seconds": 0.5}


@pytest.mark.parametrize("failback", [False, True])
async def test_trees_stick_fail_over_and_fail_back(launch, http, replicas, failback):
    reps, served = replicas
    sc = await launch(deployments=pool(reps, mode="dynamo_headers", health_check=HEALTH, failback=failback))
    balancer = sc.router.deployment("pool").balancer
    index = {r.url: r.index for r in reps}
    trees = [f"tree-{i}" for i in range(TREES)]

    first = await run_round(http, sc.proxy_url, trees, served)
    assert all(len(v) == 1 for v in first.values())  # every request of a tree hit one upstream
    owner = {t: next(iter(v)) for t, v in first.items()}
    assert set(owner.values()) == {0, 1, 2}
    assert all(owner[t] == index[balancer.rank(t)[0].url] for t in trees)  # rendezvous ranking

    victim = reps[0]
    moved = [t for t in trees if owner[t] == 0]
    others = [t for t in trees if owner[t] != 0]
    await victim.stop()
    # the other trees keep working while the dead replica is being detected
    for _ in range(3):
        assert await run_round(http, sc.proxy_url, others, served) == {t: {owner[t]} for t in others}
    await wait_for(lambda: not balancer.is_healthy(balancer.upstreams[0]))

    second = await run_round(http, sc.proxy_url, trees, served)
    for t in moved:  # only the dead replica's trees moved, each to its next-ranked upstream
        assert second[t] == {index[balancer.rank(t)[1].url]}
    assert all(second[t] == {owner[t]} for t in others)

    await victim.start()  # same port
    await wait_for(lambda: balancer.is_healthy(balancer.upstreams[0]))
    third = await run_round(http, sc.proxy_url, trees, served)
    for t in moved:
        assert third[t] == ({0} if failback else second[t])
    assert all(third[t] == {owner[t]} for t in others)
    fresh = [t for t in (f"new-{i}" for i in range(40)) if index[balancer.rank(t)[0].url] == 0]
    assert fresh and all(v == {0} for v in (await run_round(http, sc.proxy_url, fresh, served)).values())


async def test_passive_marking_on_connect_failure(launch, http, replicas):
    reps, served = replicas
    sc = await launch(deployments=pool(reps))  # no active health checks
    balancer = sc.router.deployment("pool").balancer
    index = {r.url: r.index for r in reps}
    trees = [f"p-{i}" for i in range(TREES)]
    owner = {t: next(iter(v)) for t, v in (await run_round(http, sc.proxy_url, trees, served)).items()}
    victim_trees = [t for t in trees if owner[t] == 1]
    others = [t for t in trees if owner[t] != 1]
    await reps[1].stop()
    tree = victim_trees[0]
    statuses = [await send(http, sc.proxy_url, tree, None) for _ in range(4)]
    assert statuses[-1] == 200 and statuses.count(200) >= 2  # a failed connect fails the tree over
    assert served[tree][-1] == index[balancer.rank(tree)[1].url]
    assert not balancer.is_healthy(balancer.upstreams[1])
    assert await run_round(http, sc.proxy_url, others, served) == {t: {owner[t]} for t in others}


async def test_override_dropped_when_tree_ends(launch, http, replicas):
    reps, served = replicas
    sc = await launch(deployments=pool(reps, health_check=HEALTH))
    balancer = sc.router.deployment("pool").balancer
    await reps[2].stop()
    await wait_for(lambda: not balancer.is_healthy(balancer.upstreams[2]))
    trees = [t for t in (f"o-{i}" for i in range(40)) if balancer.rank(t)[0] is balancer.upstreams[2]][:5]
    await run_round(http, sc.proxy_url, trees, served)
    assert balancer.overrides == len(trees)
    for t in trees:
        for s, _ in sessions_of(t):
            sc.router.close_session(s)
    assert balancer.overrides == 0
