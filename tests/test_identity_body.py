"""Body identity signals read from a scanned body: only the members they need, within bounds."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
from multidict import CIMultiDict

from sidecar.config import IdentityConfig
from sidecar.identity import (
    FINGERPRINT_MAX_MESSAGES,
    FINGERPRINT_PARSE_BYTES,
    FINGERPRINT_PREFIX,
    MAX_ID_BYTES,
    IdentityReader,
)
from sidecar.jsonbody import scan_body
from sidecar.modes.ids import fit_id


def session(doc: bytes | dict[str, Any], /, **cfg: Any) -> str | None:
    """The session the body signals configured by ``cfg`` read from ``doc``."""
    reader = IdentityReader(IdentityConfig(**cfg))
    data = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    return reader.read_body(CIMultiDict(), scan_body(data, 128, reader.body_keys)).session


def test_the_reader_names_the_keys_its_signals_read() -> None:
    reader = IdentityReader(IdentityConfig(body=["metadata.user_id", "user"], fingerprint=True))
    assert reader.body_keys == (b"metadata", b"user", b"system", b"messages")
    assert IdentityReader(IdentityConfig()).body_keys == ()


def test_string_signals() -> None:
    cfg = {"body": ["prompt_cache_key", "user"]}
    assert session({"user": "u", "prompt_cache_key": " pck "}, **cfg) == "pck"
    assert session({"user": "u", "prompt_cache_key": 7}, **cfg) == "u"  # not a string: next signal
    assert session(b'{"user":"a","user":"b"}', **cfg) == "b"  # a repeated key reads as its last
    assert session(b'{"us\\u0065r":"\\u00e9"}', **cfg) == "\u00e9"  # escapes decoded
    # kept in the reader's id size (sessions.max_id_bytes, 512 by default) in its fitted form
    assert session({"user": "x" * MAX_ID_BYTES}, **cfg) == fit_id("x" * MAX_ID_BYTES, 512)
    assert session({"user": "x" * (MAX_ID_BYTES + 1)}, **cfg) is None  # longer than any session id
    assert session(b'{"user":"\\ud800"}', **cfg) is None
    assert session(b"[1]", **cfg) is None and session(b'{"user":', **cfg) is None


def test_metadata_user_id() -> None:
    cfg = {"body": ["metadata.user_id"]}
    claude = orjson.dumps({"device_id": "d", "session_id": "claude-1"}).decode()
    assert session({"metadata": {"user_id": claude}}, **cfg) == "claude-1"
    assert session({"metadata": {"user_id": "user_x_account_y_session_legacy-2"}}, **cfg) == "legacy-2"
    assert session(b'{"metadata":{"user_id":"a_session_1","user_id":"a_session_2"}}', **cfg) == "2"
    assert session({"metadata": {"user_id": 5}}, **cfg) is None
    assert session({"metadata": ["user_id"]}, **cfg) is None
    assert session({"metadata": {"other": claude}}, **cfg) is None


def old_fingerprint(body: dict[str, Any]) -> str | None:
    """The fingerprint as computed from a whole parsed body (before bodies were scanned)."""
    system: list[Any] = [body["system"]] if "system" in body else []
    for message in body["messages"]:
        if not isinstance(message, dict):
            continue
        if message.get("role") == "user":
            key = orjson.dumps([system, message.get("content")], option=orjson.OPT_SORT_KEYS)
            return FINGERPRINT_PREFIX + hashlib.blake2b(key, digest_size=16).hexdigest()
        if message.get("role") in ("system", "developer"):
            system.append(message.get("content"))
    return None


def test_fingerprints_are_those_of_the_parsed_body() -> None:
    bodies = [
        {"messages": [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}]},
        {
            "system": [{"type": "text", "text": "A", "cache": {"b": 1, "a": 2}}],
            "messages": [{"content": [{"type": "text", "text": "q"}], "role": "user"}],
        },
        {
            "messages": [
                7,
                {"role": "developer", "content": None},
                {"role": "assistant", "content": "x"},
                {"role": "user"},
            ]
        },
    ]
    for body in bodies:
        assert session(body, fingerprint=True) == old_fingerprint(body) is not None
    assert session({"messages": [{"role": "assistant", "content": "x"}]}, fingerprint=True) is None
    assert session({"messages": "user"}, fingerprint=True) is None


def test_small_parts_are_canonical_large_parts_are_hashed_as_sent() -> None:
    small = b'{"messages":[{"role":"user","content":{"b":1,"a":2}}]}'
    spaced = b'{ "messages" : [ { "content" : { "a" : 2 , "b" : 1 } , "role" : "user" } ] }'
    assert session(small, fingerprint=True) == session(spaced, fingerprint=True)
    big = [{"text": "x" * FINGERPRINT_PARSE_BYTES, "k": i} for i in range(2)]
    one = {"messages": [{"role": "user", "content": big}]}
    later_turn = {
        "messages": [
            {"role": "user", "content": big},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "more"},
        ]
    }
    assert session(one, fingerprint=True) == session(later_turn, fingerprint=True) is not None
    assert session(one, fingerprint=True) != session(
        {"messages": [{"role": "user", "content": big[:1]}]}, fingerprint=True
    )


def test_the_fingerprint_reads_a_bounded_number_of_messages() -> None:
    before = [{"role": "assistant", "content": str(i)} for i in range(FINGERPRINT_MAX_MESSAGES - 1)]
    user = {"role": "user", "content": "hi"}
    assert session({"messages": [*before, user]}, fingerprint=True) is not None
    assert session({"messages": [*before, {"role": "tool"}, user]}, fingerprint=True) is None


def test_lineage_still_comes_from_headers() -> None:
    reader = IdentityReader(IdentityConfig(body=["user"]))
    body = scan_body(b'{"user":"child"}', 128, reader.body_keys)
    ident = reader.read_body(CIMultiDict({"X-Parent-Session-ID": "parent", "X-Session-Final": "true"}), body)
    assert (ident.session, ident.parent, ident.final) == ("child", "parent", True)
