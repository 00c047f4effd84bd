"""Prompt-cache accounting behind the engines' interface (tests/usage_support.py plays the engine):
per session on the tree's nodes, per tree in the views, per deployment, mode and turn bucket in
the metrics, the live view's bounded aggregates; the answers of the sessions API, /ui/data.json
and /metrics on a real admin listener; and the opt-in request patch that asks for usage."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from sidecar.accounting import SLOT_SECONDS, TURN_BUCKETS, WINDOW_SECONDS, Accounting, turn_bucket, with_include_usage
from sidecar.config import build_config
from sidecar.context import TurnOutcome
from sidecar.jsonscan import INLINE_BYTES
from sidecar.lineage import prompt_cache as expected
from sidecar.metrics import Metrics
from sidecar.router import BODY, READY, WORK, Admission, RequestHead, Router
from sidecar.usage import Usage, UsageOutcome
from sidecar.wiring import routing_core
from tests import usage_samples as s
from tests.sessions.support import Api, FakeClock, fetch_spec, metrics_text, walk
from tests.usage_support import play_turn


def make_router(**file_keys: Any) -> Router:
    cfg = build_config(flags={"upstream": "http://127.0.0.1:9", "mode": "dynamo_headers", **file_keys}, env={})
    return routing_core(cfg, Metrics(CollectorRegistry()))


def chat(prompt: int, cached: int | None) -> bytes:
    return s.chat_stream(s.chat_usage(prompt, cached))


def totals(router: Router, session: str) -> dict[str, Any]:
    node = router.tree.get(session)
    assert node is not None
    return dict(node["prompt_cache"])


def test_turn_buckets():
    assert [TURN_BUCKETS[turn_bucket(t)] for t in (1, 2, 3, 5, 6, 10, 11, 500)] == [
        "1",
        "2",
        "3-5",
        "3-5",
        "6-10",
        "6-10",
        "11+",
        "11+",
    ]


# -- per session, per tree ----------------------------------------------------------------------


async def test_each_turn_adds_to_its_session_and_unknown_is_never_zero():
    router = make_router()
    await play_turn(router, "s", chat(100, 0))
    await play_turn(router, "s", chat(150, 96))
    await play_turn(router, "s", s.chat_stream(None))  # the client did not ask for usage
    await play_turn(router, "s", chat(200, None))  # no cached count (vLLM, SGLang by default)
    await play_turn(router, "s", s.anthropic_json(s.anthropic_usage(10, 160, 30)), content_type="application/json")
    assert totals(router, "s") == expected(450, 256, 3, 2)
    # not accounted: an error status, a body that is neither JSON nor an event stream
    await play_turn(router, "s", chat(999, 999), status=500)
    await play_turn(router, "s", chat(999, 999), content_type="text/plain")
    assert totals(router, "s") == expected(450, 256, 3, 2)
    # a content-encoded body cannot be read: unknown; "identity" is no encoding
    await play_turn(router, "s", chat(999, 999), encoding="gzip")
    assert totals(router, "s") == expected(450, 256, 3, 3)
    await play_turn(router, "s", chat(10, 5), encoding="identity")
    assert totals(router, "s") == expected(460, 261, 4, 3)
    assert router.tree.get("s")["turns"] == 9


async def test_trees_sum_their_sessions_and_each_subtree_its_own():
    router = make_router()
    await play_turn(router, "root", chat(100, 0))
    await play_turn(router, "root", chat(120, 100))
    await play_turn(router, "agent", chat(50, 10), parent="root")
    await play_turn(router, "tool", chat(30, 30), parent="agent")
    await play_turn(router, "tool", s.chat_stream(None), parent="agent")
    tree = router.tree.tree("root")
    assert tree is not None
    by_id = {n["session"]: n for n in walk(tree)}
    assert by_id["root"]["prompt_cache"] == expected(220, 100, 2, 0)
    assert by_id["tool"]["subtree_prompt_cache"] == expected(30, 30, 1, 1)
    assert by_id["agent"]["subtree_prompt_cache"] == expected(80, 40, 2, 1)
    assert by_id["root"]["subtree_prompt_cache"] == expected(300, 140, 4, 1)
    # a view cut by its node budget still counts the cut sessions in the node they are counted in
    cut = router.tree.tree("root", max_nodes=1)
    assert cut is not None and cut["children"] == [] and cut["omitted"] == 2
    assert cut["subtree_prompt_cache"] == expected(300, 140, 4, 1)
    cut = router.tree.tree("root", max_depth=1)
    assert cut is not None
    (agent,) = cut["children"]
    assert agent["children"] == [] and agent["subtree_prompt_cache"] == expected(80, 40, 2, 1)


async def test_a_session_that_reuses_an_ended_id_starts_from_zero():
    router = make_router()
    await play_turn(router, "p", chat(100, 50))
    await play_turn(router, "c", chat(10, 5), parent="p")
    await play_turn(router, "p", chat(100, 50), extra_headers={"x-session-final": "true"})  # ends; held by c
    assert router.tree.get("p")["ended"] is True
    await play_turn(router, "p", chat(7, 7))  # a new session of the id, in the same place
    assert totals(router, "p") == expected(7, 7, 1, 0)


async def test_what_the_reader_is_not_asked_for():
    router = make_router(usage={"accounting": False})
    adm = router.admit(RequestHead("POST", {"x-correlation-id": "off"}))
    head = {"content-type": "text/event-stream"}
    adm.on_response(200, head)
    assert adm.usage_reader(200, head, False) is None
    on = make_router()
    sessionless = on.admit(RequestHead("POST", {}))
    sessionless.on_response(200, head)
    assert sessionless.usage_reader(200, head, False) is None
    adm = on.admit(RequestHead("POST", {"x-correlation-id": "on"}))
    adm.on_response(200, head)
    for content_type in ("application/json; charset=utf-8", "application/problem+json", "TEXT/EVENT-STREAM"):
        assert adm.usage_reader(200, {"content-type": content_type}, False) is not None
    for content_type in ("text/html", "application/octet-stream", ""):
        assert adm.usage_reader(200, {"content-type": content_type}, True) is None
    assert adm.usage_reader(201, head, False) is None
    adm.finish(TurnOutcome.COMPLETED)
    assert adm.usage_reader(200, head, False) is None  # finished: nothing more is counted
    adm.on_usage(Usage(UsageOutcome.REPORTED, 5, 5))
    assert totals(on, "on") == expected(0, 0, 0, 0)


# -- metrics ------------------------------------------------------------------------------------


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for family in text_string_to_metric_families(text)
        for x in family.samples
    }


def ratio_by_turn(text: str) -> dict[str, float]:
    """``sum by (turn) (cached) / sum by (turn) (prompt)``: the query docs/reference.md gives."""
    prompt: dict[str, float] = {}
    cached: dict[str, float] = {}
    for (name, labels), value in samples(text).items():
        turn = dict(labels).get("turn")
        if name == "sidecar_prompt_tokens_total":
            prompt[turn] = prompt.get(turn, 0) + value
        elif name == "sidecar_cached_prompt_tokens_total":
            cached[turn] = cached.get(turn, 0) + value
    return {turn: cached[turn] / prompt[turn] for turn in prompt if prompt[turn]}


# -- the live view's aggregates -------------------------------------------------------------------


def test_live_view_aggregates_cover_the_last_fifteen_minutes_in_a_fixed_ring():
    clock = FakeClock(1_700_000_000.0)
    metrics = Metrics(CollectorRegistry())
    cfg = build_config(flags={"upstream": "http://127.0.0.1:9"}, env={})
    acc = Accounting(cfg, metrics, clock=clock)
    for turn, prompt, cached in ((1, 100, 0), (2, 110, 100), (2, 90, 90), (7, 400, 390), (12, 500, 480)):
        acc.count("default", "none", turn, Usage(UsageOutcome.REPORTED, prompt, cached))
    acc.count("default", "none", 3, Usage(UsageOutcome.MISSING))
    snap = acc.snapshot()
    assert (snap["window_seconds"], snap["slot_seconds"], snap["turn_buckets"]) == (
        WINDOW_SECONDS,
        SLOT_SECONDS,
        list(TURN_BUCKETS),
    )
    assert [(b["turn"], b["prompt_tokens"], b["cached_tokens"], b["reported_responses"]) for b in snap["by_turn"]] == [
        ("1", 100, 0, 1),
        ("2", 200, 190, 2),
        ("3-5", 0, 0, 0),
        ("6-10", 400, 390, 1),
        ("11+", 500, 480, 1),
    ]
    assert snap["by_turn"][2]["cached_ratio"] is None and snap["by_turn"][1]["cached_ratio"] == 0.95
    assert snap["unknown_responses"] == 1
    (slot,) = snap["series"]
    assert slot["at"] == int(clock.now // SLOT_SECONDS) * SLOT_SECONDS
    assert slot["prompt_tokens"] == [100, 200, 0, 400, 500] and slot["cached_tokens"] == [0, 190, 0, 390, 480]
    clock.advance(2 * SLOT_SECONDS)
    acc.count("default", "none", 2, Usage(UsageOutcome.REPORTED, 10, 10))
    snap = acc.snapshot()
    assert [x["at"] for x in snap["series"]] == sorted(x["at"] for x in snap["series"]) and len(snap["series"]) == 2
    assert snap["by_turn"][1]["prompt_tokens"] == 210
    clock.advance(WINDOW_SECONDS - SLOT_SECONDS)  # the first slot left the window, the second not
    snap = acc.snapshot()
    assert len(snap["series"]) == 1 and snap["by_turn"][1]["prompt_tokens"] == 10 and snap["unknown_responses"] == 0
    for _ in range(3 * WINDOW_SECONDS // SLOT_SECONDS):  # a ring: old rounds are reused, never kept
        clock.advance(SLOT_SECONDS)
        acc.count("default", "none", 1, Usage(UsageOutcome.REPORTED, 1, 0))
    snap = acc.snapshot()
    assert len(snap["series"]) == WINDOW_SECONDS // SLOT_SECONDS and snap["by_turn"][0]["prompt_tokens"] == 30
    assert len(acc._slots) == WINDOW_SECONDS // SLOT_SECONDS


# -- the answers on a real admin listener --------------------------------------------------------


async def test_sessions_api_views_and_metrics_answer_the_accounting(start_sidecar, upstream, http_session):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    router = sc.router
    for prompt, cached in ((1000, 0), (1100, 1000), (1300, 1100)):
        await play_turn(router, "main", chat(prompt, cached))
    await play_turn(router, "sub", chat(400, 0), parent="main")
    await play_turn(router, "sub", s.responses_stream(s.responses_usage(500, 384)), parent="main")
    await play_turn(router, "sub", s.chat_stream(None), parent="main")
    spec = await fetch_spec(http_session, sc.admin_url)
    api = Api(http_session, sc.admin_url, spec)  # every answer validated against /openapi.json
    status, main = await api.get("main")
    assert status == 200 and main["prompt_cache"] == expected(3400, 2100, 3, 0)
    status, sub = await api.get("sub")
    assert status == 200 and sub["prompt_cache"] == expected(900, 384, 2, 1)
    status, tree = await api.tree("sub")
    assert status == 200 and tree["session"] == "main"
    assert tree["subtree_prompt_cache"] == expected(4300, 2484, 5, 1)
    assert tree["children"][0]["subtree_prompt_cache"] == expected(900, 384, 2, 1)

    async with http_session.get(sc.admin_url + "/ui/data.json") as resp:
        data = orjson.loads(await resp.read())
    (entry,) = data["trees"]
    assert entry["tree"]["subtree_prompt_cache"] == expected(4300, 2484, 5, 1)
    by_turn = {b["turn"]: b for b in data["prompt_cache"]["by_turn"]}
    assert (by_turn["1"]["prompt_tokens"], by_turn["1"]["cached_tokens"]) == (1400, 0)
    assert (by_turn["2"]["prompt_tokens"], by_turn["2"]["cached_tokens"]) == (1600, 1384)
    assert (by_turn["3-5"]["prompt_tokens"], by_turn["3-5"]["cached_tokens"]) == (1300, 1100)
    assert data["prompt_cache"]["unknown_responses"] == 1

    text = await metrics_text(http_session, sc.admin_url)
    got = samples(text)
    labels = (("deployment", "default"), ("mode", "dynamo_headers"))
    assert got[("sidecar_prompt_tokens_total", (*labels, ("turn", "2")))] == 1600
    assert got[("sidecar_cached_prompt_tokens_total", (*labels, ("turn", "2")))] == 1384
    assert got[("sidecar_usage_responses_total", (*labels, ("outcome", "reported")))] == 5
    assert got[("sidecar_usage_responses_total", (*labels, ("outcome", "missing")))] == 1
    assert ratio_by_turn(text) == {"1": 0.0, "2": 1384 / 1600, "3-5": 1100 / 1300}


@pytest.fixture
async def http_session():
    import aiohttp

    async with aiohttp.ClientSession() as s:
        yield s


# -- asking for usage (opt-in) -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "patched"),
    [
        (
            b'{"model":"m","stream":true,"messages":[]}',
            b'{"model":"m","stream":true,"messages":[],"stream_options":{"include_usage":true}}',
        ),
        (
            b'{"stream": true, "stream_options": {"continuous_usage_stats": true}, "x": 1}',
            b'{"stream": true, "stream_options": {"continuous_usage_stats": true,"include_usage":true}, "x": 1}',
        ),
        (
            b'{"stream":true,"stream_options":{"include_usage":false}}',
            b'{"stream":true,"stream_options":{"include_usage":true}}',
        ),
        (b'{"stream":true,"stream_options":null}', b'{"stream":true,"stream_options":{"include_usage":true}}'),
        (b'{"stream":true,"stream_options":{"include_usage":true}}', None),  # asks already
        (b'{"stream":false,"messages":[]}', None),
        (b'{"messages":[]}', None),
        (b'{"stream":"true"}', None),
        (b"[1,2]", None),
        (b'{"stream":true', None),  # not JSON
    ],
)
def test_include_usage_patch_changes_only_what_it_must(body, patched):
    assert with_include_usage(body, 64) == patched
    if patched is not None:
        assert orjson.loads(patched)["stream_options"]["include_usage"] is True


async def test_include_usage_is_opt_in_per_deployment_and_for_chat_completions_of_a_session():
    """The admission reads the body of a request that asks for usage (BODY), patches it (inline,
    or as WORK on the body pool when large) and forwards the patched body (READY)."""
    body = b'{"stream":true,"messages":[]}'
    chat = b"/v1/chat/completions"

    def admit(router: Router, headers: dict[str, str], target: bytes = chat, method: str = "POST") -> Admission:
        return router.admit(RequestHead(method, {"content-length": "1", **headers}, target))

    def forwarded(adm: Admission, data: bytes | list[bytes], size: int) -> bytes | None:
        assert adm.need == BODY
        adm.body(data, size)
        if adm.need == WORK:
            assert adm.work is not None
            adm.worked(adm.work())
        assert adm.need == READY and adm.decision is not None
        return adm.decision.body

    off = make_router()
    assert admit(off, {"x-correlation-id": "a"}).need == READY  # streamed through, unread
    on = make_router(usage={"include_usage": True})
    for target in (chat, b"/openai/v1/chat/completions?x=1", b"/v1/chat/completions/"):
        adm = admit(on, {"x-correlation-id": "a"}, target)
        assert orjson.loads(forwarded(adm, body, len(body)))["stream_options"] == {"include_usage": True}, target
        adm.finish(TurnOutcome.COMPLETED)
    for method, target in (("POST", b"/v1/responses"), ("POST", b"/v1/messages"), ("GET", chat)):
        adm = admit(on, {"x-correlation-id": "a"}, target, method)
        assert adm.need == READY and adm.decision is not None and adm.decision.body is None, (method, target)
        adm.finish(TurnOutcome.COMPLETED)
    assert admit(on, {}).need == READY  # nothing is accounted without a session: unread
    # a body in pieces, larger than what is patched on the loop: WORK, then patched
    padded = b'{"stream":true,"pad":"' + b"x" * (2 * INLINE_BYTES) + b'"}'
    adm = admit(on, {"x-correlation-id": "b"})
    pieces = [padded[:100], padded[100:]]
    assert orjson.loads(forwarded(adm, pieces, len(padded)))["stream_options"] == {"include_usage": True}
    adm.finish(TurnOutcome.COMPLETED)
    # above limits.max_parsed_body_bytes: forwarded unchanged (not refused)
    big = b'{"stream":true,"pad":"' + b"x" * (9 * 1024 * 1024) + b'"}'
    adm = admit(on, {"x-correlation-id": "c"})
    assert adm.limit >= len(big)
    assert forwarded(adm, big, len(big)) == big
    adm.finish(TurnOutcome.COMPLETED)
    # a turn in flight while its body is read: a client that leaves releases it
    adm = admit(on, {"x-correlation-id": "d"})
    assert on.tree.get("d")["in_flight"] == 1
    adm.finish(TurnOutcome.CLIENT_ABORTED)
    assert on.tree.get("d")["in_flight"] == 0
