"""The router's contract with the engines: a provisional decision is replaced by the complete one
``transform_body`` returns; a call that raises returned no decision and left nothing admitted;
body work an engine abandons releases what it admitted; ``finish`` releases a turn once.

The engines' side of the same contract is checked on the wire in tests/proxy and tests/modes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from sidecar import errors
from sidecar.config import build_config
from sidecar.context import RoutingContext, TurnOutcome
from sidecar.jsonscan import INLINE_BYTES
from sidecar.metrics import Metrics
from sidecar.modes.base import BodyPatch
from sidecar.router import BodyWork, Decision, RequestHead, Router
from sidecar.wiring import routing_core

SESSION = "conv-1"


def make_router(mode: str = "dynamo_nvext", **flags: Any) -> Router:
    cfg = build_config(flags={"upstream": "http://127.0.0.1:9", "mode": mode, **flags}, env={})
    return routing_core(cfg, Metrics(CollectorRegistry()))


def head(size: int, session: str | None = SESSION, method: str = "POST") -> RequestHead:
    headers = {"content-length": str(size)}
    if session is not None:
        headers["x-correlation-id"] = session
    return RequestHead(method, headers)


def in_flight(router: Router, session: str = SESSION) -> int | None:
    node = router.tree.get(session)
    return None if node is None else node["in_flight"]


def body_of(size: int) -> bytes:
    """A JSON object body of exactly ``size`` bytes."""
    base = b'{"model":"m","pad":""}'
    return base[:-2] + b"x" * (size - len(base)) + b'"}'


def run_work(result: Decision | BodyWork) -> Decision:
    """What an engine does with body work: run it, resume, until the decision comes back."""
    while isinstance(result, BodyWork):
        result = result.resume(result.run())
    return result


class FailingPatch:
    """A body mode whose patch hook raises (replaces a deployment's mode in these tests)."""

    name = "dynamo_nvext"
    mutates_body = True

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def body_patch(self, ctx: RoutingContext) -> BodyPatch | None:
        raise RuntimeError("patch failed")


class FailingHeaders:
    name = "session_id_header"
    mutates_body = False

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def request_headers(self, ctx: RoutingContext) -> Any:
        raise RuntimeError("headers failed")


def test_transform_body_returns_the_complete_decision_and_admits_only_then() -> None:
    router = make_router()
    body = body_of(200)
    provisional = router.route(head(len(body)))
    assert provisional.needs_body and provisional.ctx is None and provisional.body is None
    assert in_flight(router) is None  # nothing is admitted before the body is read

    complete = run_work(router.transform_body(provisional, body, len(body)))
    assert complete is not provisional and not complete.needs_body
    assert complete.ctx is not None and complete.ctx.session == SESSION and complete.ctx.turn == 1
    sent = orjson.loads(complete.body)
    assert sent["nvext"]["session_control"]["session_id"] == SESSION and sent["pad"] == "x" * (200 - 22)
    assert in_flight(router) == 1

    router.finish(provisional, TurnOutcome.UPSTREAM_FAILED)  # holds nothing: changes nothing
    assert in_flight(router) == 1
    router.finish(complete, TurnOutcome.COMPLETED)
    assert in_flight(router) == 0
    router.finish(complete, TurnOutcome.COMPLETED)  # released once: a second call changes nothing
    node = router.tree.get(SESSION)
    assert node is not None and node["in_flight"] == 0 and node["turns"] == 1 and not node["ended"]


def test_a_sessionless_body_is_forwarded_as_received() -> None:
    router = make_router()
    body = body_of(64)
    provisional = router.route(head(len(body), session=None))
    assert not provisional.needs_body and provisional.ctx is None  # nothing to rewrite: streamed
    assert router.tree.get(SESSION) is None


def test_a_failing_patch_hook_raises_and_leaves_nothing_admitted() -> None:
    router = make_router()
    dep = router.deployments[0]
    dep.mode = FailingPatch(dep.mode)  # type: ignore[assignment]
    body = body_of(200)
    provisional = router.route(head(len(body)))
    with pytest.raises(errors.ProxyError) as caught:
        router.transform_body(provisional, body, len(body))
    assert caught.value.type == errors.MODE_ERROR and "body_patch" in str(caught.value)
    assert in_flight(router) == 0  # admitted, then released by the router itself
    router.finish(provisional, TurnOutcome.UPSTREAM_FAILED)  # what the engine holds: nothing
    node = router.tree.get(SESSION)
    assert node is not None and node["in_flight"] == 0 and node["turns"] == 1


def test_a_failing_header_hook_raises_and_leaves_nothing_admitted() -> None:
    router = make_router("session_id_header")
    dep = router.deployments[0]
    dep.mode = FailingHeaders(dep.mode)  # type: ignore[assignment]
    with pytest.raises(errors.ProxyError) as caught:
        router.route(head(0, method="GET"))
    assert caught.value.type == errors.MODE_ERROR and "request_headers" in str(caught.value)
    assert in_flight(router) == 0


def test_a_refused_non_object_body_leaves_nothing_admitted() -> None:
    router = make_router(non_object_body="reject")
    provisional = router.route(head(7))
    with pytest.raises(errors.ProxyError) as caught:
        router.transform_body(provisional, b"[1,2,3]", 7)
    assert caught.value.type == errors.INVALID_JSON_BODY
    assert in_flight(router) == 0


def test_abandoned_body_work_releases_what_it_admitted() -> None:
    router = make_router()
    body = body_of(INLINE_BYTES + 1000)
    provisional = router.route(head(len(body)))
    work = router.transform_body(provisional, body, len(body))
    assert isinstance(work, BodyWork)  # the scan runs off the loop
    splice = work.resume(work.run())  # admitted; the splice runs off the loop too
    assert isinstance(splice, BodyWork) and in_flight(router) == 1
    splice.abandon(TurnOutcome.CLIENT_ABORTED)  # the client left while it ran
    assert in_flight(router) == 0


def test_abandoned_work_before_admission_holds_nothing() -> None:
    router = make_router()
    body = body_of(INLINE_BYTES + 1000)
    work = router.transform_body(router.route(head(len(body))), body, len(body))
    assert isinstance(work, BodyWork)
    work.abandon(TurnOutcome.CLIENT_ABORTED)
    assert router.tree.get(SESSION) is None


def test_a_large_body_completes_through_body_work() -> None:
    router = make_router()
    body = body_of(INLINE_BYTES + 1000)
    complete = run_work(router.transform_body(router.route(head(len(body))), body, len(body)))
    sent = orjson.loads(complete.body)
    assert sent["nvext"]["session_control"]["session_id"] == SESSION
    assert sent["pad"] == "x" * (len(body) - 22)
    router.finish(complete, TurnOutcome.COMPLETED)
    assert in_flight(router) == 0
