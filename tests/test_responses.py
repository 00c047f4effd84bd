"""Responses API chaining, directly: the response id read from a body's first bytes
(sidecar.responses), the bounded map of response ids (sidecar.state.ResponseIds), and the
previous_response_id / conversation body signals (sidecar.identity)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from multidict import CIMultiDict

from sidecar.config import IdentityConfig
from sidecar.identity import IdentityReader
from sidecar.jsonbody import scan_body
from sidecar.responses import MAX_SCAN_BYTES, FirstBytes, dechunk, response_id
from sidecar.state import ResponseIds

CREATED = {
    "type": "response.created",
    "sequence_number": 0,
    "response": {"id": "resp_1", "object": "response", "output": [{"id": "msg_9"}], "status": "in_progress"},
}
STREAM = b"event: response.created\ndata: " + orjson.dumps(CREATED) + b"\n\nevent: response.in_progress\ndata: {}\n\n"
BODY = orjson.dumps({"id": "resp_2", "object": "response", "output": [{"id": "msg_1", "content": []}]})


def chunked(payload: bytes, size: int) -> bytes:
    """``payload`` framed as chunks of ``size`` bytes (with an extension on the first), ended."""
    parts = [payload[i : i + size] for i in range(0, len(payload), size)]
    framed = [b"%x;ext=1\r\n%s\r\n" % (len(parts[0]), parts[0])]
    framed += [b"%x\r\n%s\r\n" % (len(p), p) for p in parts[1:]]
    return b"".join(framed) + b"0\r\n\r\n"


def fed(reads: list[bytes], is_chunked: bool = False) -> tuple[int, str | None]:
    """Feed reads until done: (reads used, the id)."""
    reader = FirstBytes(is_chunked)
    for n, data in enumerate(reads, 1):
        done, rid = reader.feed(data)
        if done:
            return n, rid
    return len(reads), None


def split(data: bytes, at: int) -> list[bytes]:
    return [data[:at], data[at:]]


@pytest.mark.parametrize("at", [1, 10, 30, 60, 120])
def test_the_first_event_of_a_stream_names_the_response_in_any_split(at):
    assert fed(split(STREAM, at)) == (2, "resp_1")  # (the event's end is in the second read)
    assert fed(split(chunked(STREAM, 37), at), True) == (2, "resp_1")


@pytest.mark.parametrize("at", [1, 5, 9, 14, 30])
def test_a_json_body_names_the_response_at_top_level_in_any_split(at):
    assert fed(split(BODY, at)) == (1 if at >= len(b'{"id":"resp_2"') else 2, "resp_2")
    assert fed(split(chunked(BODY, 11), at), True)[1] == "resp_2"


def test_one_read_holding_the_id_is_enough():
    assert fed([STREAM]) == (1, "resp_1")
    assert fed([b"\r\n" + BODY]) == (1, "resp_2")
    assert fed([b": keep-alive\n\n" + STREAM.replace(b"\n", b"\r\n")]) == (1, "resp_1")


@pytest.mark.parametrize(
    "body",
    [
        b'{"object": "response", "output": [{"id": "msg_1"}], "id": "resp_late"}',
        b'{"a": {"id": "nested"}, "b": ["id", {"id": "x"}], "id": "resp_late"}',
        b'{"s": "a \\"id\\": \\"fake\\"", "id": "resp_late"}',
    ],
)
def test_only_the_top_level_id_counts(body):
    assert response_id(body) == (True, "resp_late")


@pytest.mark.parametrize(
    "body",
    [
        b'{"error": {"id": "e", "message": "no"}}',
        b'{"id": 7, "object": "response"}',
        b'{"id": {"x": 1}}',
        b'{"id": "' + b"x" * 300 + b'"}',
        b'{"id": "a\\u0000b"}',
        b"[1, 2]",
        b"event: error\ndata: not json\n\n",
        b'data: {"type": "error", "id": "no"}\n\n',
        b"data: [1]\n\n",
    ],
)
def test_a_body_that_names_no_response_id_is_done_without_one(body):
    assert response_id(body) == (True, None)


def test_incomplete_beginnings_wait_for_more_bytes_within_the_bound():
    assert response_id(b'{"object": "response", "id": "res') == (False, None)
    assert response_id(b"event: response.created\ndata: {") == (False, None)
    assert response_id(b"") == (False, None)
    assert response_id(b"", True) == (True, None)
    reader = FirstBytes(False)
    assert reader.feed(b'{"pad": "' + b"x" * (MAX_SCAN_BYTES - 20)) == (False, None)
    assert reader.feed(b"x" * 100) == (True, None)  # the bound is reached: no more reads


def test_dechunk_takes_the_framing_off_as_far_as_it_is_complete():
    assert dechunk(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n") == (b"hello world", True)
    assert dechunk(b"5;x=y\r\nhel") == (b"hel", False)
    assert dechunk(b"5\r\nhello\r\n") == (b"hello", False)
    assert dechunk(b"zz\r\n") == (b"", True)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_response_ids_are_bounded_in_count_and_age():
    clock = Clock()
    ids = ResponseIds(max_ids=3, ttl=10.0, clock=clock)
    for n in range(5):
        ids.remember(f"r{n}", "dep", f"s{n}")
    assert len(ids) == 3 and ids.get("r0") is None and ids.get("r4") == ("dep", "s4")
    clock.now = 9.9
    assert ids.get("r2") == ("dep", "s2")
    clock.now = 10.0
    assert ids.get("r2") is None  # aged out at lookup
    ids.remember("r5", "dep", "s5")  # and dropped from the old end as new ones come
    assert len(ids) <= 2 and ids.get("r5") == ("dep", "s5")
    ids.remember("r5", "other", "s6")  # a later answer under the same id replaces it
    assert ids.get("r5") == ("other", "s6")


def read_body(doc: dict[str, Any], headers: dict[str, str] | None = None, **cfg: Any) -> Any:
    reader = IdentityReader(IdentityConfig(**cfg))
    return reader.read_body(CIMultiDict(headers or {}), scan_body(orjson.dumps(doc), 128, reader.body_keys))


def test_conversation_signal():
    cfg = {"body": ["conversation"]}
    assert read_body({"conversation": "conv_1", "input": "hi"}, **cfg).session == "conv_1"
    assert read_body({"conversation": {"id": " conv_2 "}, "input": "hi"}, **cfg).session == "conv_2"
    assert read_body({"conversation": {"name": "x"}}, **cfg).session is None
    assert read_body({"conversation": 5}, **cfg).session is None


def test_previous_response_id_names_the_response_a_request_continues():
    cfg = {"body": ["conversation", "previous_response_id"]}
    chained = read_body({"input": "hi", "previous_response_id": "resp_7"}, {"X-Session-Final": "yes"}, **cfg)
    assert (chained.session, chained.response, chained.final) == (None, "resp_7", True)
    assert read_body({"input": "hi"}, **cfg).response == ""  # a Responses request continuing none
    assert read_body({"input": "hi", "previous_response_id": None}, **cfg).response == ""
    assert read_body({"messages": []}, **cfg).response is None  # no Responses request
    # a signal before it in the list wins
    assert read_body({"input": "hi", "conversation": "c", "previous_response_id": "r"}, **cfg).session == "c"
    assert IdentityReader(IdentityConfig(**cfg)).body_keys == (b"conversation", b"previous_response_id", b"input")
