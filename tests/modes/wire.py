"""Helpers of the wire-level mode tests: drive sessions through a real sidecar and collect what arrived."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from sidecar.app import Sidecar

# Odd whitespace, key order and escapes: header-only modes must forward these bytes untouched.
ODD_BODY = b'{ "z" :1,\n\t"model":"m" ,  "messages":[{"role":"user","content":"h\\u00e9"}],"a":[ 2,1 ] }\n'


@dataclass(frozen=True)
class Step:
    """One request of a session: its index within the session and whether it is the last."""

    session: str
    parent: str | None
    turn: int
    final: bool


def plan(sessions: list[tuple[str, str | None]], order: list[int], turns: int = 3) -> list[Step]:
    """Requests in ``order`` (indices into ``sessions``); each session's last turn is final."""
    seen = [0] * len(sessions)
    out = []
    for i in order:
        seen[i] += 1
        sid, parent = sessions[i]
        out.append(Step(sid, parent, seen[i], seen[i] == turns))
    assert seen == [turns] * len(sessions)
    return out


async def settled(sc: Sidecar, session: str) -> None:
    """Wait until the sidecar has finished the session's last request (response bytes can reach the
    client a moment before the proxy records the turn as over)."""
    for _ in range(500):
        node = sc.router.tree.get(session)
        if node is None or node["in_flight"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"session {session!r} still has requests in flight")


async def drive(
    sc: Sidecar, steps: list[Step], body: bytes, extra: dict[str, str] | None = None, path: str = "/v1/chat/completions"
) -> None:
    async with aiohttp.ClientSession() as client:
        for n, step in enumerate(steps):
            headers = {
                "X-Correlation-ID": step.session,
                "X-Request-ID": f"req-{n}",
                "Content-Type": "application/json",
                **(extra or {}),
            }
            if step.parent is not None:
                headers["X-Parent-Session-ID"] = step.parent
            if step.final:
                headers["X-Session-Final"] = "true"
            async with client.post(sc.proxy_url + path, data=body, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
            await settled(sc, step.session)
