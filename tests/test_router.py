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
from sidecar.router import BODY, READY, REFUSED, WORK, Admission, RequestHead, Router
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


def run_work(adm: Admission) -> Admission:
    """What an engine does with body work: run it, hand its result back, until it is decided."""
    while adm.need == WORK:
        assert adm.work is not None
        adm.worked(adm.work())
    return adm


def fed(adm: Admission, body: bytes) -> Admission:
    """The admission given its whole body (it needed it)."""
    assert adm.need == BODY
    adm.body(body, len(body))
    return adm


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


def test_the_body_completes_the_decision_and_admits_only_then() -> None:
    router = make_router()
    body = body_of(200)
    adm = router.admit(head(len(body)))
    assert adm.need == BODY and adm.decision is None and adm.limit == router.default.max_parsed_body_bytes
    assert in_flight(router) is None  # nothing is admitted before the body is read

    run_work(fed(adm, body))
    complete = adm.decision
    assert adm.need == READY and complete is not None
    assert complete.ctx is not None and complete.ctx.session == SESSION and complete.ctx.turn == 1
    assert complete.body is not None
    sent = orjson.loads(complete.body)
    assert sent["nvext"]["session_control"]["session_id"] == SESSION and sent["pad"] == "x" * (200 - 22)
    assert in_flight(router) == 1

    adm.finish(TurnOutcome.COMPLETED)
    assert in_flight(router) == 0
    adm.finish(TurnOutcome.UPSTREAM_FAILED)  # released once: a second call changes nothing
    node = router.tree.get(SESSION)
    assert node is not None and node["in_flight"] == 0 and node["turns"] == 1 and not node["ended"]
    with pytest.raises(RuntimeError):
        router.admit(head(len(body))).worked(None)  # fed what it does not need: refused loudly


def test_a_sessionless_body_is_forwarded_as_received() -> None:
    router = make_router()
    body = body_of(64)
    adm = router.admit(head(len(body), session=None))
    assert adm.need == READY and adm.decision is not None and adm.decision.ctx is None  # streamed
    assert adm.decision.body is None
    assert router.tree.get(SESSION) is None


def test_a_failing_patch_hook_refuses_and_leaves_nothing_admitted() -> None:
    router = make_router()
    dep = router.deployments[0]
    dep.mode = FailingPatch(dep.mode)  # type: ignore[assignment]
    body = body_of(200)
    adm = fed(router.admit(head(len(body))), body)
    assert adm.need == REFUSED and adm.error is not None and adm.decision is None
    assert adm.error.type == errors.MODE_ERROR and "body_patch" in str(adm.error) and adm.reason == adm.error.type
    assert in_flight(router) == 0  # admitted, then released by the admission itself
    adm.finish(TurnOutcome.UPSTREAM_FAILED)  # what the engine still calls: changes nothing
    node = router.tree.get(SESSION)
    assert node is not None and node["in_flight"] == 0 and node["turns"] == 1


def test_a_failing_header_hook_refuses_and_leaves_nothing_admitted() -> None:
    router = make_router("session_id_header")
    dep = router.deployments[0]
    dep.mode = FailingHeaders(dep.mode)  # type: ignore[assignment]
    adm = router.admit(head(0, method="GET"))
    assert adm.need == REFUSED and adm.error is not None
    assert adm.error.type == errors.MODE_ERROR and "request_headers" in str(adm.error)
    assert in_flight(router) == 0


def test_a_refused_non_object_body_leaves_nothing_admitted() -> None:
    router = make_router(non_object_body="reject")
    adm = fed(router.admit(head(7)), b"[1,2,3]")
    assert adm.need == REFUSED and adm.error is not None
    assert adm.error.type == errors.INVALID_JSON_BODY
    assert in_flight(router) == 0


def test_finishing_during_body_work_releases_what_it_admitted() -> None:
    router = make_router()
    body = body_of(INLINE_BYTES + 1000)
    adm = fed(router.admit(head(len(body))), body)
    assert adm.need == WORK and adm.work is not None  # the scan runs off the loop
    adm.worked(adm.work())  # admitted; the splice runs off the loop too
    assert adm.need == WORK and adm.work is not None and in_flight(router) == 1
    work = adm.work
    adm.finish(TurnOutcome.CLIENT_ABORTED)  # the client left while it ran
    assert in_flight(router) == 0
    adm.worked(work())  # its result comes back after: changes nothing
    assert in_flight(router) == 0 and adm.decision is not None and adm.decision.body is None


def test_finishing_during_work_before_admission_holds_nothing() -> None:
    router = make_router()
    body = body_of(INLINE_BYTES + 1000)
    adm = fed(router.admit(head(len(body))), body)
    assert adm.need == WORK and adm.work is not None
    adm.finish(TurnOutcome.CLIENT_ABORTED)
    adm.worked(adm.work())
    assert router.tree.get(SESSION) is None


def test_a_large_body_completes_through_body_work() -> None:
    router = make_router()
    body = body_of(INLINE_BYTES + 1000)
    adm = run_work(fed(router.admit(head(len(body))), body))
    complete = adm.decision
    assert adm.need == READY and complete is not None and complete.body is not None
    sent = orjson.loads(complete.body)
    assert sent["nvext"]["session_control"]["session_id"] == SESSION
    assert sent["pad"] == "x" * (len(body) - 22)
    adm.finish(TurnOutcome.COMPLETED)
    assert in_flight(router) == 0
