"""Which deployment serves a request: binding, selector header, body model, default; 409s."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest

from tests.sessions.support import Api, deployment, fetch_spec, metrics_text
from tests.upstream import RecordingUpstream, start_upstream


@pytest.fixture
async def two_upstreams() -> AsyncIterator[tuple[RecordingUpstream, RecordingUpstream]]:
    ups = (RecordingUpstream(), RecordingUpstream())
    runners = [await start_upstream(u) for u in ups]
    yield ups
    for r in runners:
        await r.cleanup()


async def post(http, sc, headers=None, body: dict | bytes | None = None, path="/v1/chat/completions"):
    data = body if isinstance(body, bytes) else orjson.dumps(body or {"model": "x"})
    async with http.post(sc.proxy_url + path, data=data, headers=headers or {}) as resp:
        return resp.status, await resp.json()


async def test_selector_header_picks_and_is_stripped(launch, http, two_upstreams):
    a, b = two_upstreams
    sc = await launch(
        deployments=[deployment("a", a.url, mode="dynamo_headers"), deployment("b", b.url, mode="smg_routing_key")]
    )
    assert (await post(http, sc, {"X-Sidecar-Deployment": "b", "X-Correlation-ID": "s1"}))[0] == 200
    assert (await post(http, sc, {"X-Sidecar-Deployment": "b"}))[0] == 200  # sessionless too
    assert (await post(http, sc))[0] == 200  # default: the first
    assert len(a.received) == 1 and len(b.received) == 2
    assert b.received[0].header("X-SMG-Routing-Key") == "s1"
    assert all(r.header("X-Sidecar-Deployment") is None for r in a.received + b.received)
    status, err = await post(http, sc, {"X-Sidecar-Deployment": "zzz"})
    assert status == 400 and err["error"]["type"] == "unknown_deployment"


async def test_custom_selector_header_and_default_deployment(launch, http, two_upstreams):
    a, b = two_upstreams
    sc = await launch(
        deployments=[deployment("a", a.url), deployment("b", b.url)], deployment_header="X-Pool", default_deployment="b"
    )
    assert (await post(http, sc))[0] == 200
    assert (await post(http, sc, {"X-Pool": "a"}))[0] == 200
    assert (len(a.received), len(b.received)) == (1, 1)
    assert a.received[0].header("X-Pool") is None


async def test_binding_sticks_and_conflicts_are_409(launch, http, two_upstreams):
    a, b = two_upstreams
    sc = await launch(
        deployments=[deployment("a", a.url, mode="dynamo_headers"), deployment("b", b.url, mode="dynamo_headers")]
    )
    assert (await post(http, sc, {"X-Correlation-ID": "bound", "X-Sidecar-Deployment": "b"}))[0] == 200
    assert (await post(http, sc, {"X-Correlation-ID": "bound"}))[0] == 200  # binding, no selector
    status, err = await post(http, sc, {"X-Correlation-ID": "bound", "X-Sidecar-Deployment": "a"})
    assert status == 409
    e = err["error"]
    assert e["type"] == "deployment_conflict" and e["bound_deployment"] == "b" and e["requested_deployment"] == "a"
    assert "'a'" in e["message"] and "'b'" in e["message"]
    assert (len(a.received), len(b.received)) == (0, 2)
    text = await metrics_text(http, sc.admin_url)
    assert 'sidecar_rejected_requests_total{reason="deployment_conflict"} 1.0' in text


async def test_api_binding_at_creation(launch, http, two_upstreams):
    a, b = two_upstreams
    sc = await launch(deployments=[deployment("a", a.url), deployment("b", b.url)])
    api = Api(http, sc.admin_url, await fetch_spec(http, sc.admin_url))
    await api.create(deployment="b", session_id="made")
    assert (await post(http, sc, {"X-Correlation-ID": "made"}))[0] == 200
    status, err = await post(http, sc, {"X-Correlation-ID": "made", "X-Sidecar-Deployment": "a"})
    assert status == 409 and err["error"]["bound_deployment"] == "b"
    assert (len(a.received), len(b.received)) == (0, 1)


MODELS = {"a": ["llama-8b"], "b": ["qwen-32b", "qwen-7b"]}


async def test_body_model_selects_deployment(launch, http, two_upstreams):
    a, b = two_upstreams
    sc = await launch(
        deployments=[
            deployment("a", a.url, mode="dynamo_headers", models=MODELS["a"]),
            deployment("b", b.url, mode="dynamo_headers", models=MODELS["b"]),
        ]
    )
    body = {"model": "qwen-7b", "messages": [{"role": "user", "content": "hi"}]}
    assert (await post(http, sc, {"X-Correlation-ID": "m1"}, body))[0] == 200
    assert (await post(http, sc, {}, {"model": "llama-8b"}))[0] == 200  # sessionless
    assert (await post(http, sc, {}, {"model": "unknown"}))[0] == 200  # default
    assert (await post(http, sc, {}, b"not json"))[0] == 200  # default, passed unchanged
    async with http.get(sc.proxy_url + "/v1/models") as resp:  # no body: default, nothing read
        assert resp.status == 200
    assert [r.path for r in b.received] == ["/v1/chat/completions"]
    assert orjson.loads(b.received[0].body) == body  # header mode: body bytes untouched
    assert b.received[0].header("X-Dynamo-Session-ID") == "m1"
    assert len(a.received) == 4 and a.received[2].body == b"not json"
    # the model bound the session: a later request naming the other model is a conflict only
    # when its body is read, which a bound header-mode session never needs
    assert (await post(http, sc, {"X-Correlation-ID": "m1"}, {"model": "llama-8b"}))[0] == 200
    assert len(b.received) == 2


async def test_model_conflicts_when_body_is_read(launch, http, two_upstreams):
    a, b = two_upstreams
    sc = await launch(
        deployments=[
            deployment("a", a.url, mode="dynamo_headers", models=MODELS["a"]),
            deployment("b", b.url, mode="dynamo_nvext", models=MODELS["b"]),
        ]
    )
    status, _ = await post(http, sc, {"X-Correlation-ID": "n1"}, {"model": "qwen-32b"})
    assert status == 200
    assert b.received[0].json()["nvext"]["session_control"]["session_id"] == "n1"  # rewritten after choice
    status, err = await post(http, sc, {"X-Correlation-ID": "n1"}, {"model": "llama-8b"})
    assert status == 409 and err["error"]["type"] == "deployment_conflict"
    assert err["error"]["bound_deployment"] == "b" and err["error"]["requested_deployment"] == "a"
    status, err = await post(http, sc, {"X-Sidecar-Deployment": "b", "X-Correlation-ID": "n2"}, {"model": "llama-8b"})
    assert status == 409
    assert len(b.received) == 1 and not a.received
    assert sc.router.tree.get("n2") is None  # refused before admission: no session was started


async def test_model_selection_body_is_bounded(launch, http, two_upstreams):
    a, b = two_upstreams
    sc = await launch(
        deployments=[
            deployment("a", a.url, models=MODELS["a"], limits={"max_body_bytes": 2000}),
            deployment("b", b.url, models=MODELS["b"], limits={"max_body_bytes": 100}),
        ]
    )
    big = {"model": "qwen-7b", "pad": "x" * 500}
    status, err = await post(http, sc, {}, big)
    assert status == 413 and err["error"]["type"] == "request_too_large" and err["error"]["deployment"] == "b"
    assert (await post(http, sc, {}, {"model": "llama-8b", "pad": "x" * 500}))[0] == 200
    status, _ = await post(http, sc, {}, b"x" * 3000)
    assert status == 413
    assert len(a.received) == 1 and not b.received


async def test_strict_deployment_chosen_by_model(launch, http, two_upstreams):
    a, b = two_upstreams
    sc = await launch(
        deployments=[
            deployment("a", a.url, models=MODELS["a"]),
            deployment("b", b.url, models=MODELS["b"], strict=True, mode="dynamo_headers"),
        ]
    )
    status, err = await post(http, sc, {"X-Correlation-ID": "unknown"}, {"model": "qwen-7b"})
    assert status == 404 and err["error"]["type"] == "session_not_found"
    status, err = await post(http, sc, {}, {"model": "qwen-7b"})
    assert status == 400 and err["error"]["type"] == "session_required"
    assert not b.received


async def test_body_limit_before_choice_is_the_largest(launch, http, two_upstreams):
    """Engines buffer up to ``decision.max_body_bytes`` before the model chose the deployment."""
    a, b = two_upstreams
    sc = await launch(
        deployments=[
            deployment("a", a.url, models=MODELS["a"], limits={"max_body_bytes": 100}),
            deployment("b", b.url, models=MODELS["b"], limits={"max_body_bytes": 2000}),
        ]
    )
    assert (await post(http, sc, {}, {"model": "qwen-7b", "pad": "x" * 500}))[0] == 200
    status, err = await post(http, sc, {}, {"model": "llama-8b", "pad": "x" * 500})
    assert status == 413 and err["error"]["deployment"] == "a"
    assert len(b.received) == 1 and not a.received
