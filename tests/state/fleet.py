"""What the shared-store tests send to a fleet and read back: proxied requests, sessions API
calls, the upstream's ``finish_session`` calls, metric samples."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import orjson

from tests.modes.wire import settled


async def post(
    http: aiohttp.ClientSession,
    sc: Any,
    session: str | None,
    *,
    parent: str | None = None,
    final: bool = False,
    path: str = "/v1/chat/completions",
    extra: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    """One proxied request of ``session`` (``X-Correlation-ID``), once the replica recorded its end."""
    headers = {**(extra or {})}
    if session is not None:
        headers["X-Correlation-ID"] = session
    if parent is not None:
        headers["X-Parent-Session-ID"] = parent
    if final:
        headers["X-Session-Final"] = "true"
    async with http.post(sc.proxy_url + path, headers=headers, data=b'{"model":"m"}') as resp:
        body = await resp.read()
        status = resp.status
    if session is not None:
        await settled(sc, session)
    return status, orjson.loads(body) if body else {}


async def api(
    http: aiohttp.ClientSession, method: str, url: str, body: Any = None, *, token: str | None = None
) -> tuple[int, Any]:
    headers = {} if token is None else {"Authorization": "Bearer " + token}
    async with http.request(method, url, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


def finishes(upstream: Any, session: str) -> list[Any]:
    """The ``POST /finish_session`` calls the upstream received for exactly ``session``."""
    return [
        r
        for r in upstream.received
        if r.path.startswith("/finish_session") and parse_qs(urlsplit(r.path).query).get("session_id") == [session]
    ]


def metric(sc: Any, name: str, labels: dict[str, str] | None = None) -> float:
    return sc.metrics.registry.get_sample_value(name, labels or {}) or 0.0
