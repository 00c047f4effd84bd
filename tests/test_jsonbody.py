"""Splicing a patch into a JSON body's bytes, and reading members, without re-serializing."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.jsonbody import RepeatedKeys, load_bounded, members, scan_body, splice, string_at
from sidecar.jsonscan import MAX_HITS, TOO_DEEP

PATH = ("nvext", "session_control")
OWNED = ("session_id", "action", "timeout")
BIND = {"session_id": "s1", "action": "bind", "timeout": 300}
CLOSE = {"session_id": "s1", "action": "close"}


def patched(
    data: bytes,
    values: dict[str, Any] = BIND,
    path: tuple[str, ...] = PATH,
    owned: tuple[str, ...] = OWNED,
    names: tuple[bytes, ...] = (),
) -> bytes:
    body = scan_body(data, 128, names)
    assert body.is_object
    return splice(body, path, values, owned)


def test_everything_outside_the_patched_object_is_byte_identical() -> None:
    data = (
        b'{ "z" : 123456789012345678901234567890 ,\n\t"b":1e2, "c" : -0.0, "d":"h\\u00e9\\ud83d\\ude00\\/",'
        b' "d":"dup", "a" : [ 1 ,2 ] }\r\n'
    )
    assert patched(data) == data[:-4] + b',"nvext":{"session_control":' + orjson.dumps(BIND) + b"}" + data[-4:]
    # Located by the first scan or found by a second pass: the same bytes.
    assert patched(data, names=(b"nvext",)) == patched(data)


@pytest.mark.parametrize(
    ("data", "want"),
    [
        # No nvext; an empty object, with and without whitespace.
        (b"{}", b'{"nvext":{"session_control":{"session_id":"s1","action":"close"}}}'),
        (b"{ }", b'{"nvext":{"session_control":{"session_id":"s1","action":"close"}} }'),
        # An nvext with other keys: kept, session_control appended after them.
        (
            b'{"nvext": {"top_k" : 3}}',
            b'{"nvext": {"top_k" : 3,"session_control":{"session_id":"s1","action":"close"}}}',
        ),
        (b'{"nvext":{ }}', b'{"nvext":{"session_control":{"session_id":"s1","action":"close"} }}'),
        # A session_control with foreign keys: they stay (in place), the owned ones go, the mode's follow.
        (
            b'{"nvext":{"session_control":{"timeout": 9 ,"trace":"t","action":"open"},"x":1}}',
            b'{"nvext":{"session_control":{"trace":"t","session_id":"s1","action":"close"},"x":1}}',
        ),
        (
            b'{"nvext":{"session_control":{"a":1, "timeout": 9 , "b":2}}}',
            b'{"nvext":{"session_control":{"a":1 , "b":2,"session_id":"s1","action":"close"}}}',
        ),
        (
            b'{"nvext":{"session_control":{"session_id":"c","timeout":1}}}',
            b'{"nvext":{"session_control":{"session_id":"s1","action":"close"}}}',
        ),
        # Owned keys the client repeats: every occurrence goes.
        (
            b'{"nvext":{"session_control":{"action":1,"k":0,"action":2,"action":3}}}',
            b'{"nvext":{"session_control":{"k":0,"session_id":"s1","action":"close"}}}',
        ),
        # A non-object nvext or session_control: replaced in place.
        (
            b'{"a":1,"nvext":"text","b":2}',
            b'{"a":1,"nvext":{"session_control":{"session_id":"s1","action":"close"}},"b":2}',
        ),
        (
            b'{"nvext":{"session_control":null , "k":1}}',
            b'{"nvext":{"session_control":{"session_id":"s1","action":"close"} , "k":1}}',
        ),
        # nvext repeated: the last is the one patched, the earlier ones are removed.
        (
            b'{"nvext":{"x":1}, "m":0, "nvext" : {"y":2}}',
            b'{ "m":0, "nvext" : {"y":2,"session_control":{"session_id":"s1","action":"close"}}}',
        ),
        (b'{"m":0,"nvext":1,"nvext":2}', b'{"m":0,"nvext":{"session_control":{"session_id":"s1","action":"close"}}}'),
        (
            b'{"nvext":{},"nvext":[],"nvext":{"k":1},"m":0}',
            b'{"nvext":{"k":1,"session_control":{"session_id":"s1","action":"close"}},"m":0}',
        ),
        # session_control repeated inside nvext: likewise.
        (
            b'{"nvext":{"session_control":{"a":1},"session_control":{"b":2}}}',
            b'{"nvext":{"session_control":{"b":2,"session_id":"s1","action":"close"}}}',
        ),
        # Keys written with escapes are the same keys.
        (
            b'{"nv\\u0065xt":{"session\\u005fcontrol":{"\\u0061ction":"open","k":1}}}',
            b'{"nv\\u0065xt":{"session\\u005fcontrol":{"k":1,"session_id":"s1","action":"close"}}}',
        ),
    ],
)
def test_merge_cases(data: bytes, want: bytes) -> None:
    assert patched(data, CLOSE) == want
    assert json.loads(want)  # valid JSON


def test_a_patch_without_values_only_removes() -> None:
    assert (
        patched(b'{"nvext":{"session_control":{"action":"x","k":1}}}', {}) == b'{"nvext":{"session_control":{"k":1}}}'
    )
    assert patched(b'{"nvext":{"session_control":{"action":"x"}}}', {}) == b'{"nvext":{"session_control":{}}}'
    assert patched(b"{}", {}) == b'{"nvext":{"session_control":{}}}'


def test_a_one_key_path_and_values_not_in_owned() -> None:
    assert (
        patched(b'{"m": 1, "tag": "old"}', {"tag": "new"}, ("meta",), ())
        == b'{"m": 1, "tag": "old","meta":{"tag":"new"}}'
    )
    assert (
        patched(b'{"meta": {"tag": "old", "x": 1}}', {"tag": "new"}, ("meta",), ())
        == b'{"meta": { "x": 1,"tag":"new"}}'
    )


def test_repeated_keys_beyond_the_scanner_bound_are_refused() -> None:
    many = b",".join([b'"action":1'] * (MAX_HITS + 1))
    with pytest.raises(RepeatedKeys):
        patched(b'{"nvext":{"session_control":{' + many + b"}}}")
    many = b",".join([b'"nvext":1'] * (MAX_HITS + 1))
    with pytest.raises(RepeatedKeys):
        patched(b"{" + many + b"}")


def test_bad_patches_are_type_errors() -> None:
    with pytest.raises(TypeError):
        patched(b"{}", {"k": {1, 2}})  # not serializable
    with pytest.raises(TypeError):
        patched(b"{}", BIND, ())
    with pytest.raises(TypeError):
        patched(b"{}", {1: "x"})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        patched(b"{}", BIND, ("nvext", 3))  # type: ignore[arg-type]


KEYS = st.sampled_from(["a", "nvext", "session_control", "session_id", "action", "timeout", "trace", "é"])
LEAVES = st.one_of(
    st.none(), st.integers(-(10**30), 10**30), st.text(max_size=6), st.floats(allow_nan=False, allow_infinity=False)
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=12,
)


def merged(body: dict[str, Any], control: dict[str, Any]) -> dict[str, Any]:
    """What a parser reads after the patch (the documented dict semantics)."""
    out = dict(body)
    nvext = out.get("nvext")
    nvext = dict(nvext) if isinstance(nvext, dict) else {}
    old = nvext.get("session_control")
    sc = {k: v for k, v in old.items() if k not in OWNED} if isinstance(old, dict) else {}
    sc.update(control)
    nvext["session_control"] = sc
    out["nvext"] = nvext
    return out


@settings(max_examples=300, deadline=None)
@given(
    body=st.dictionaries(KEYS, VALUES, max_size=5),
    control=st.sampled_from([BIND, CLOSE, {"session_id": "s"}]),
    indent=st.sampled_from([None, 1, "\t"]),
    seps=st.sampled_from([(",", ":"), (" , ", " : ")]),
)
def test_generated_bodies_read_as_the_merge_and_keep_their_other_members(
    body: dict[str, Any], control: dict[str, Any], indent: Any, seps: tuple[str, str]
) -> None:
    data = json.dumps(body, indent=indent, separators=seps, ensure_ascii=False).encode()
    out = patched(data, control)
    assert json.loads(out) == merged(body, control)
    # Every top-level member but nvext is the client's bytes, in the client's order.
    names = tuple(k.encode() for k in body if k != "nvext")
    before, after = scan_body(data, 128, names), scan_body(out, 128, names)
    spans = [(data, before.hits[i + 1 : i + 5]) for i in range(0, len(before.hits), 5)]
    spans_out = [(out, after.hits[i + 1 : i + 5]) for i in range(0, len(after.hits), 5)]
    assert [d[h[0] : h[3]] for d, h in spans] == [d[h[0] : h[3]] for d, h in spans_out]


def test_readers() -> None:
    data = b'{"model":"m\\u00e9","n":1,"s":"' + b"x" * 100 + b'","meta":{"user_id":"u","user_id":"v"}}'
    body = scan_body(data, 128, (b"model", b"n", b"s", b"meta", b"absent"))
    assert body.string(b"model", 64) == "mé"
    assert body.string(b"n", 64) is None  # not a string
    assert body.string(b"s", 99) is None and body.string(b"s", 100) == "x" * 100
    assert body.string(b"absent", 64) is None
    vs, ve = body.member(b"meta")  # type: ignore[misc]
    found = members(data, vs, ve, (b"user_id",))
    assert [string_at(data, f[3], f[4], 10) for f in found] == ["u", "v"]
    assert load_bounded(data, vs, ve, 1000) == {"user_id": "v"}
    fragment = load_bounded(data, vs, ve, 10)
    assert isinstance(fragment, orjson.Fragment) and orjson.dumps([fragment]) == b"[" + data[vs:ve] + b"]"
    assert scan_body(b"[" * 200, 128, ()).status == TOO_DEEP
    assert not scan_body(b"[1]", 128, ()).is_object and not scan_body(b"{", 128, ()).is_object
