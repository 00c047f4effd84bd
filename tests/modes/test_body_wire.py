"""Body modes on the wire, on both engines: the upstream receives the client's bytes with only
the mode's field spliced in; parsed bodies are bounded in size and depth; large bodies are read
off the event loop."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import orjson
import pytest

import sidecar.router as router_module
from sidecar.jsonscan import INLINE_BYTES
from tests.modes.wire import settled

BIND = b'"session_control":{"session_id":"s-1","action":"bind","timeout":300}'
# The splice is the same for both protocols; bind's every turn carries all of the mode's keys.
BIND_OPTIONS = ["protocol=bind"]
PARSED_LIMIT = 8 * 1024 * 1024


async def post(
    sc: Any,
    body: bytes | AsyncIterator[bytes],
    session: str | None = "s-1",
    headers: dict[str, str] | None = None,
    http: aiohttp.ClientSession | None = None,
) -> tuple[int, Any]:
    """POST ``body`` through the sidecar; the status and the parsed JSON answer (or raw bytes)."""
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if session is not None:
        hdrs["X-Correlation-ID"] = session
    own = http is None
    client = http or aiohttp.ClientSession()
    try:
        data: Any = io.BytesIO(body) if isinstance(body, bytes) and len(body) > 1 << 20 else body  # sent with a length
        async with client.post(sc.proxy_url + "/v1/chat/completions", data=data, headers=hdrs) as resp:
            raw = await resp.read()
            try:
                return resp.status, orjson.loads(raw)
            except orjson.JSONDecodeError:
                return resp.status, raw
    finally:
        if own:
            await client.close()


async def in_flight(sc: Any, session: str) -> int:
    """The session's requests in flight, as the sessions API reports them."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{sc.admin_url}/v1/sessions/{session}") as resp:
            assert resp.status == 200, await resp.text()
            return int((await resp.json())["in_flight"])


# -- byte preservation ------------------------------------------------------------------------

ODD = (
    b' {"z" : 123456789012345678901234567890 ,\n\t"b":1e2,"c":-0.0, "model":"m\\u00e9\\ud83d\\ude00",'
    b'"model" : "dup","messages":[ {"role":"user","content":"\\u0048i \\"there\\"\\/"} ], "a":[ 2 ,1 ] }\r\n'
)


async def test_the_upstream_gets_the_clients_bytes_plus_the_field(upstream, start_sidecar) -> None:
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_nvext", mode_opt=BIND_OPTIONS)
    for _ in range(2):  # the first request of a deployment and a later one (the scan then locates nvext)
        assert (await post(sc, ODD))[0] == 200
    want = ODD[:-4] + b',"nvext":{' + BIND + b"}" + ODD[-4:]
    assert [r.body for r in upstream.received] == [want, want]
    assert upstream.received[0].header("Content-Length") == str(len(want))


MERGES = [
    # An nvext with other keys.
    (
        b'{"model":"m","nvext":{"top_k" : 3, "extra_fields":["worker_id"]}}',
        b'{"model":"m","nvext":{"top_k" : 3, "extra_fields":["worker_id"],' + BIND + b"}}",
    ),
    # A session_control with foreign keys and owned ones.
    (
        b'{"nvext":{"session_control":{"session_id":"spoof","trace":"t-1", "timeout":1},"k":2},"n":1e2}',
        b'{"nvext":{"session_control":{"trace":"t-1","session_id":"s-1","action":"bind","timeout":300},"k":2},"n":1e2}',
    ),
    # A non-object nvext, replaced where it stood.
    (b'{"nvext": [1, 2], "model": "m"}', b'{"nvext": {' + BIND + b'}, "model": "m"}'),
    # nvext repeated: the last one is patched, the earlier ones removed.
    (b'{"nvext":{"a":1},"model":"m","nvext":{"b":2}}', b'{"model":"m","nvext":{"b":2,' + BIND + b"}}"),
]


@pytest.mark.parametrize(
    "session",
    ['quote"d', "back\\slash", "tab\tinside", "plain-0123456789abcdef", "x" * 200],
)
async def test_session_ids_are_escaped_in_the_spliced_field(upstream, start_sidecar, session: str) -> None:
    """The members the sidecar writes itself (plain ASCII ids) and those it leaves to orjson (ids
    with bytes JSON escapes) reach the upstream as the same valid JSON."""
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_nvext", mode_opt=BIND_OPTIONS)
    assert (await post(sc, b'{"model":"m"}', session=session))[0] == 200
    body = upstream.received[0].body
    control = {"session_id": session, "action": "bind", "timeout": 300}
    assert body == b'{"model":"m","nvext":{"session_control":' + orjson.dumps(control) + b"}}"
    assert orjson.loads(body)["nvext"]["session_control"]["session_id"] == session


@pytest.mark.parametrize(("body", "want"), MERGES)
async def test_nvext_merges_on_the_wire(upstream, start_sidecar, body: bytes, want: bytes) -> None:
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_nvext", mode_opt=BIND_OPTIONS)
    assert (await post(sc, body))[0] == 200
    assert upstream.received[0].body == want


# -- limits -----------------------------------------------------------------------------------


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 1 << 20):
        yield data[i : i + (1 << 20)]


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_body_over_the_parsed_limit_is_413_and_never_forwarded(upstream, start_sidecar, chunked: bool) -> None:
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_nvext", mode_opt=BIND_OPTIONS)
    body = b'{"model":"m","pad":"' + b"x" * (9 * 1024 * 1024) + b'"}'
    status, answer = await post(sc, _chunks(body) if chunked else body)
    assert status == 413
    err = answer["error"]
    assert (err["type"], err["limit"], err["setting"]) == (
        "request_too_large",
        PARSED_LIMIT,
        "limits.max_parsed_body_bytes",
    )
    assert "max_parsed_body_bytes" in err["message"]
    assert upstream.received == []
    # A header mode streams the same body through (its limit is max_body_bytes).
    sc2 = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    assert (await post(sc2, body))[0] == 200
    assert upstream.received[0].body == body


async def test_the_parsed_limit_is_configurable(upstream, start_sidecar) -> None:
    sc = await start_sidecar(
        upstream=upstream.url, mode="dynamo_nvext", mode_opt=BIND_OPTIONS, limits={"max_parsed_body_bytes": 100}
    )
    assert (await post(sc, b'{"model":"m"}'))[0] == 200
    status, answer = await post(sc, b'{"pad":"' + b"x" * 100 + b'"}')
    assert (status, answer["error"]["limit"]) == (413, 100)
    assert len(upstream.received) == 1


@pytest.mark.parametrize("depth", [129, 300])
async def test_a_body_nested_too_deep_is_400_and_the_session_is_not_left_in_flight(
    upstream, start_sidecar, depth: int
) -> None:
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_nvext", mode_opt=BIND_OPTIONS)
    assert (await post(sc, b'{"model":"m"}'))[0] == 200  # the session exists
    deep = b'{"a":' * (depth - 1) + b"[]" + b"}" * (depth - 1)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        status, answer = await post(sc, deep, http=http)
        assert status == 400
        assert answer["error"]["type"] == "json_too_deep" and answer["error"]["limit"] == 128
        assert "max_json_depth" in answer["error"]["message"]
        # The connection was answered, not dropped: it serves the next request.
        assert (await post(sc, b'{"model":"m"}', http=http))[0] == 200
    await settled(sc, "s-1")
    assert await in_flight(sc, "s-1") == 0
    assert len(upstream.received) == 2
    assert sc.metrics.registry.get_sample_value("sidecar_rejected_requests_total", {"reason": "json_too_deep"}) == 1


async def test_the_depth_limit_is_configurable_and_nesting_within_it_passes(upstream, start_sidecar) -> None:
    sc = await start_sidecar(
        upstream=upstream.url, mode="dynamo_nvext", mode_opt=BIND_OPTIONS, limits={"max_json_depth": 255}
    )
    ok = b'{"a":' * 254 + b"1" + b"}" * 254
    assert (await post(sc, ok))[0] == 200
    assert upstream.received[0].body == ok[:-1] + b',"nvext":{' + BIND + b"}}"
    status, answer = await post(sc, b"[" * 256 + b"]" * 256)
    assert (status, answer["error"]["type"]) == (400, "json_too_deep")


async def test_non_object_bodies_pass_unchanged_large_or_small(upstream, start_sidecar) -> None:
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_nvext", mode_opt=BIND_OPTIONS)
    bodies = [b"[1, 2]", b"[" + b"1," * INLINE_BYTES + b"1]", b'{"a": 1', b'{"a":"' + b"x" * INLINE_BYTES + b'"']
    for body in bodies:
        assert (await post(sc, body))[0] == 200
    assert [r.body for r in upstream.received] == bodies
    reg = sc.metrics.registry
    for outcome in ("passthrough_not_object", "passthrough_invalid_json"):
        assert reg.get_sample_value("sidecar_body_rewrites_total", {"mode": "dynamo_nvext", "outcome": outcome}) == 2


# -- large bodies: read on a worker thread ----------------------------------------------------


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Holds body scans that run off the event loop until released: (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    real = router_module.scan_body

    def gated(data: bytes, max_depth: int, names: tuple[bytes, ...]) -> Any:
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(30)
        return real(data, max_depth, names)

    monkeypatch.setattr(router_module, "scan_body", gated)
    yield entered, release
    release.set()


async def wait_for(event: threading.Event) -> None:
    for _ in range(3000):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the body work never started")


def empties(size: int) -> bytes:
    """A JSON object of about ``size`` bytes holding an array of empty objects."""
    head, tail = b'{"model":"m","a":[', b"]}"
    n = (size - len(head) - len(tail) + 1) // 3
    return head + b",".join([b"{}"] * n) + tail


async def test_a_large_body_is_read_while_other_requests_are_answered(upstream, start_sidecar, gate) -> None:
    entered, release = gate
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_nvext", mode_opt=BIND_OPTIONS)
    assert (await post(sc, b'{"model":"m"}', session="small-0"))[0] == 200
    big = empties(PARSED_LIMIT)
    assert len(big) <= PARSED_LIMIT
    task = asyncio.ensure_future(post(sc, big))
    await wait_for(entered)
    # The large body's scan is held on its thread: the loop still answers other connections.
    for i in range(1, 4):
        assert (await post(sc, b'{"model":"m"}', session=f"small-{i}"))[0] == 200
    assert not task.done()
    release.set()
    assert (await task)[0] == 200
    assert [r.header("X-Correlation-ID") for r in upstream.received] == [
        "small-0",
        "small-1",
        "small-2",
        "small-3",
        "s-1",
    ]
    assert upstream.received[-1].body == big[:-1] + b',"nvext":{' + BIND + b"}}"
    await settled(sc, "s-1")


async def test_a_client_that_leaves_during_body_work_ends_its_turn(upstream, start_sidecar, gate) -> None:
    entered, release = gate
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_nvext", mode_opt=BIND_OPTIONS)
    assert (await post(sc, b'{"model":"m"}'))[0] == 200
    body = b'{"model":"m","pad":"' + b"x" * (2 * INLINE_BYTES) + b'"}'
    task = asyncio.ensure_future(post(sc, body))
    await wait_for(entered)
    task.cancel()  # the client closes its connection
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    await settled(sc, "s-1")
    assert await in_flight(sc, "s-1") == 0
    assert len(upstream.received) == 1
    # The sidecar carries on.
    assert (await post(sc, b'{"model":"m"}'))[0] == 200
    assert len(upstream.received) == 2


async def test_large_bodies_name_sessions_and_deployments(two_upstreams, start_sidecar) -> None:
    a, b = two_upstreams
    deployments = [
        {"name": "a", "upstreams": [a.url], "models": ["ma"], "mode": "dynamo_headers"},
        {
            "name": "b",
            "upstreams": [b.url],
            "models": ["mb"],
            "mode": "dynamo_nvext",
            "mode_options": {"protocol": "bind"},
        },
    ]
    sc = await start_sidecar(deployments=deployments, identity={"body": ["user"]})
    pad = b"x" * (2 * INLINE_BYTES)
    big_a = b'{"model":"ma","user":"u-a","pad":"' + pad + b'"}'
    big_b = b'{"pad":"' + pad + b'","user":"u-b","model":"mb"}'
    assert (await post(sc, big_a, session=None))[0] == 200
    assert (await post(sc, big_b, session=None))[0] == 200
    assert [r.body for r in a.received] == [big_a]
    assert a.received[0].header("X-Dynamo-Session-ID") == "u-a"
    assert (
        b.received[0].body == big_b[:-1] + b',"nvext":{"session_control":{"session_id":"u-b","action":"bind",'
        b'"timeout":300}}}'
    )


@pytest.fixture
async def two_upstreams() -> AsyncIterator[tuple[Any, Any]]:
    from tests.upstream import RecordingUpstream, start_upstream

    ups = (RecordingUpstream(), RecordingUpstream())
    runners = [await start_upstream(u) for u in ups]
    yield ups
    for r in runners:
        await r.cleanup()


@pytest.mark.parametrize("size", [16, 2 * INLINE_BYTES])
async def test_a_defect_in_body_work_is_a_500_not_a_dropped_connection(
    upstream, start_sidecar, monkeypatch, size: int
) -> None:
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_nvext", mode_opt=BIND_OPTIONS)

    def broken(data: bytes, max_depth: int, names: tuple[bytes, ...]) -> Any:
        raise RuntimeError("scanner defect")

    monkeypatch.setattr(router_module, "scan_body", broken)
    body = b'{"pad":"' + b"x" * size + b'"}'
    async with aiohttp.ClientSession() as http:
        status, answer = await post(sc, body, http=http)
        assert (status, answer["error"]["type"]) == (500, "internal_error")
    monkeypatch.undo()
    assert (await post(sc, b'{"model":"m"}'))[0] == 200
    await settled(sc, "s-1")
    assert await in_flight(sc, "s-1") == 0
    assert sc.metrics.registry.get_sample_value("sidecar_in_flight_requests") == 0
    assert len(upstream.received) == 1
