"""Helpers of the sessions and deployments tests: sidecars built from a deployments config,
an injectable wall clock, bearer tokens, validation against the served OpenAPI document, and
large trees made without their requests."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import jsonschema_rs
import yaml
from prometheus_client import CollectorRegistry

from sidecar.app import Sidecar
from sidecar.config import Config, build_config
from sidecar.context import TurnOutcome
from sidecar.router import Router

TOKEN_A = "tok-workspace-a-0123456789"
TOKEN_B = "tok-workspace-b-0123456789"
TOKEN_ADMIN = "tok-admin-000-0123456789"


class FakeClock:
    """Wall-clock seconds that only move when told to."""

    def __init__(self, now: float = 1_760_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def write_yaml(data: Any) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(data, f)
    return f.name


def tokens_file() -> str:
    return write_yaml(
        {
            "tokens": [
                {"token": TOKEN_A, "workspace": "ws-a"},
                {"token": TOKEN_B, "workspace": "ws-b"},
                {"token": TOKEN_ADMIN, "admin": True},
            ]
        }
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def make_config(engine: str, **file_keys: Any) -> Config:
    flags = {"listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "engine": engine}
    return build_config(flags=flags, env={}, file=write_yaml(file_keys))


Launch = Callable[..., Awaitable[Sidecar]]


async def launcher(engine: str) -> AsyncIterator[Launch]:
    """``await launch(clock=None, **config_file_keys)``; every sidecar is stopped afterwards."""
    started: list[Sidecar] = []

    async def launch(*, clock: FakeClock | None = None, **file_keys: Any) -> Sidecar:
        sc = Sidecar(make_config(engine, **file_keys), registry=CollectorRegistry(), session_clock=clock)
        await sc.start()
        started.append(sc)
        return sc

    yield launch
    for sc in started:
        await sc.stop()


def deployment(name: str, url: str, **keys: Any) -> dict[str, Any]:
    return {"name": name, "upstreams": [url], **keys}


class OpenAPI:
    """Validates responses against the document the admin listener serves."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        assert doc["openapi"].startswith("3.1")

    def schema_for(self, path: str, method: str, status: int) -> dict[str, Any]:
        op = self.doc["paths"][path][method.lower()]
        assert str(status) in op["responses"], f"{method} {path}: status {status} is not documented"
        return op["responses"][str(status)]["content"]["application/json"]["schema"]

    def check(self, path: str, method: str, status: int, body: Any) -> Any:
        schema = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "components": self.doc["components"],
            **self.schema_for(path, method, status),
        }
        jsonschema_rs.validator_for(schema, validate_formats=True).validate(body)
        return body


class Api:
    """A small client of the sessions API that validates every answer against the OpenAPI doc."""

    def __init__(self, http: aiohttp.ClientSession, base: str, spec: OpenAPI, token: str | None = None) -> None:
        self.http = http
        self.base = base
        self.spec = spec
        self.headers = bearer(token) if token else {}

    async def call(
        self,
        method: str,
        path: str,
        template: str,
        *,
        json: Any = None,
        params: dict[str, str] | None = None,
        data: bytes | None = None,
    ) -> tuple[int, Any]:
        async with self.http.request(
            method, self.base + path, json=json, params=params, data=data, headers=self.headers
        ) as resp:
            body = await resp.json()
            assert resp.content_type == "application/json"
            self.spec.check(template, method, resp.status, body)
            if resp.status == 401:
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            return resp.status, body

    async def create(self, **body: Any) -> tuple[int, Any]:
        return await self.call("POST", "/v1/sessions", "/v1/sessions", json=body)

    async def list(self, **params: str) -> tuple[int, Any]:
        return await self.call("GET", "/v1/sessions", "/v1/sessions", params=params)

    async def get(self, sid: str) -> tuple[int, Any]:
        return await self.call("GET", f"/v1/sessions/{sid}", "/v1/sessions/{session_id}")

    async def close(self, sid: str) -> tuple[int, Any]:
        return await self.call("POST", f"/v1/sessions/{sid}/close", "/v1/sessions/{session_id}/close")

    async def tree(self, root: str) -> tuple[int, Any]:
        return await self.call("GET", f"/v1/trees/{root}", "/v1/trees/{root}")


async def fetch_spec(http: aiohttp.ClientSession, admin_url: str) -> OpenAPI:
    async with http.get(admin_url + "/openapi.json") as resp:
        assert resp.status == 200
        return OpenAPI(await resp.json())


async def metrics_text(http: aiohttp.ClientSession, admin_url: str) -> str:
    async with http.get(admin_url + "/metrics") as resp:
        return await resp.text()


def walk(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node dict of a view's tree, its root first."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n["children"])
    return out


def fill(router: Router, children: int, grandchildren: int) -> None:
    """One tree ("big", ``a<i>`` below it, ``b<i>`` below those) straight into a sidecar's lineage
    tree, as its requests would make it; with a shared store, reported to it as they would be
    (written behind)."""
    shared = router.state.shared

    def one(session: str, parent: str | None) -> None:
        turn, _ = router.tree.begin(session, parent=parent, root_hint=None, final=False, deployment="default")
        if shared:
            router.state.begun(turn)
        router.tree.finish(turn, TurnOutcome.COMPLETED)
        if shared:
            router.state.finished(turn)

    one("big", None)
    for i in range(children):
        one(f"a{i}", "big")
    for i in range(grandchildren):
        one(f"b{i}", f"a{i % children}")
