"""The strict JSON scanner against reference parsers, on a corpus and on generated documents.

Every test runs on each implementation present: the pure-Python scanner always, the C scanner
in the compiled build. Validity is RFC 8259's: the reference is Python's json over strict UTF-8
(NaN/Infinity refused); orjson accepts a subset (it also refuses numbers beyond a double and
unpaired surrogate escapes, which the grammar allows).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar import jsonscan
from sidecar.jsonscan import INVALID, MAX_HITS, TOO_DEEP, TOO_MANY

try:
    _compiled: Any = importlib.import_module("sidecar._jsonscan")
except ImportError:
    _compiled = None

IMPLEMENTATIONS = [pytest.param((jsonscan.scan_py, jsonscan.elements_py), id="python")]
if _compiled is not None:
    IMPLEMENTATIONS.append(pytest.param((_compiled.scan, _compiled.elements), id="c"))

Scan = Callable[..., tuple[int, int, int, int, list[int]]]


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request: pytest.FixtureRequest) -> tuple[Scan, Callable[..., list[int]]]:
    return request.param  # type: ignore[no-any-return]


def test_the_compiled_build_uses_the_c_scanner() -> None:
    assert jsonscan.COMPILED == (_compiled is not None)
    assert (jsonscan.scan is not jsonscan.scan_py) == jsonscan.COMPILED
    if _compiled is not None:
        assert _compiled.CONSTANTS == {name: getattr(jsonscan, name) for name in _compiled.CONSTANTS}


def _refuse(name: str) -> Any:
    raise ValueError(name)


def reference_valid(data: bytes) -> bool:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    try:
        json.loads(text, parse_constant=_refuse)
    except (ValueError, RecursionError):
        return False
    return True


def orjson_valid(data: bytes) -> bool:
    try:
        orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return True


def depth_of(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    return 0


VALID = [
    b"{}",
    b"[]",
    b"0",
    b"-0",
    b"-0.0",
    b"1e2",
    b"1E+2",
    b"-1.5e-3",
    b"123456789012345678901234567890",
    b"1e400",
    b'""',
    b'"\\u00e9\\n\\t\\"\\\\\\/\\b\\f\\r"',
    b'"\\ud83d\\ude00"',
    b'"\\ud800"',
    b'"\\udc00x"',
    b'"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80"',
    b'"\x7f"',
    b"true",
    b"false",
    b"null",
    b" \t\n\r{} \t\n\r",
    b'{"a":1,"a":2}',
    b'{"":{"":[]}}',
    b'[[[[]]],{"k":[1,"x",null]}]',
    b'{ "a" : [ 1 , 2 ] , "b" : { } }',
]
INVALID_DOCS = [
    b"",
    b" ",
    b"\xef\xbb\xbf{}",
    b"{",
    b"}",
    b"[",
    b"[1,]",
    b'{"a":1,}',
    b"[,1]",
    b"{,}",
    b"01",
    b"-",
    b"1.",
    b".5",
    b"1e",
    b"1e+",
    b"+1",
    b"0x1",
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"tru",
    b"nul",
    b"True",
    b"[1 2]",
    b'{"a" 1}',
    b'{"a":}',
    b"{1:2}",
    b'{"a":1 "b":2}',
    b"[}",
    b"{]",
    b"[]]",
    b'"abc',
    b'"\t"',
    b'"\x00"',
    b'"\x1f"',
    b'"\\x"',
    b'"\\u12"',
    b'"\\u12g4"',
    b"'a'",
    b"[1]x",
    b"[1]\x00",
    b"\x0c1",
    b"1 2",
    b'"\xc3"',
    b'"\xc0\x80"',
    b'"\xed\xa0\x80"',
    b'"\xf4\x90\x80\x80"',
    b'"\xff"',
    b'"\x80"',
    b"/*c*/1",
    b"[1,\n]",
]


def test_corpus_valid(impl: Any) -> None:
    scan, _ = impl
    for doc in VALID:
        status, start, end, _, _ = scan(doc, 0, len(doc), 64, ())
        assert status >= 0 and reference_valid(doc), doc
        assert doc[start:end] == doc.strip(b" \t\n\r"), doc
        assert status == depth_of(json.loads(doc.decode())), doc


def test_corpus_invalid(impl: Any) -> None:
    scan, _ = impl
    for doc in INVALID_DOCS:
        assert scan(doc, 0, len(doc), 64, ())[0] == INVALID, doc
        assert not reference_valid(doc), doc


# One byte or sequence that is not plain string content: escapes, the closing quote, control
# bytes, UTF-8 (valid and not), DEL (plain) and an invalid escape.
STRING_SPECIALS = [
    b'"',
    b"\\n",
    b"\\u00e9",
    b"\\x",
    b"\x01",
    b"\x1f",
    b"\x7f",
    "\u00e9".encode(),
    "\u20ac".encode(),
    "\U0001f600".encode(),
    b"\xff",
    b"\xc3",
    b"\xed\xa0\x80",
]


def test_a_special_byte_at_every_offset_of_a_string(impl: Any) -> None:
    """The C scanner skips plain string content 16 and 8 bytes at a time: each special byte at
    each offset of a string, followed by more content or not, scans as the reference reads it
    and, in spans, as the pure-Python scanner does."""
    scan, _ = impl
    names = (b"model", b"a")
    for n in range(49):
        for special in STRING_SPECIALS:
            for tail in (b"", b"y" * 23):
                doc = b'{"model":"' + b"x" * n + special + tail + b'","a":1}'
                got = scan(doc, 0, len(doc), 64, names)
                assert (got[0] >= 0) == reference_valid(doc), doc
                assert got == jsonscan.scan_py(doc, 0, len(doc), 64, names), doc
                cut = doc[: 10 + n + len(special)]  # the input ends inside the string
                assert scan(cut, 0, len(cut), 64, names)[0] == INVALID, cut


def test_valid_json_orjson_refuses_is_accepted(impl: Any) -> None:
    """The grammar, not a double: out-of-range numbers and unpaired surrogate escapes."""
    scan, _ = impl
    for doc in (b"1e400", b"[-1e999]", b'"\\ud800"', b'{"k":"\\udfff"}'):
        assert not orjson_valid(doc) and scan(doc, 0, len(doc), 64, ())[0] >= 0


def test_depth_limit(impl: Any) -> None:
    scan, _ = impl
    for depth in (1, 2, 127, 128):
        doc = b'{"a":' * (depth - 1) + b"[]" + b"}" * (depth - 1)
        assert scan(doc, 0, len(doc), 128, ())[0] == depth
    for doc in (b"[" * 129 + b"]" * 129, b"[" * 5000, b'{"a":' * 300 + b"1" + b"}" * 300):
        assert scan(doc, 0, len(doc), 128, ())[0] == TOO_DEEP
    doc = b"[" * 2000 + b"]" * 2000  # the scanner's own bound, whatever is asked
    assert scan(doc, 0, len(doc), 10**6, ())[0] == TOO_DEEP


def test_hits_report_the_named_members_in_document_order(impl: Any) -> None:
    scan, _ = impl
    doc = b' { "model" : "m" , "nv\\u0065xt":{"model":1}, "x":[{"model":2}], "model":[1] , "\\u00e9":0 } '
    status, start, end, last, hits = scan(doc, 0, len(doc), 64, (b"model", b"nvext", "\u00e9".encode()))
    assert (status, doc[start:end]) == (3, doc.strip())
    assert doc[last:end] == b" }"
    got = [(hits[i], doc[hits[i + 1] : hits[i + 2]], doc[hits[i + 3] : hits[i + 4]]) for i in range(0, len(hits), 5)]
    assert got == [
        (0, b'"model"', b'"m"'),
        (1, b'"nv\\u0065xt"', b'{"model":1}'),
        (0, b'"model"', b"[1]"),
        (2, b'"\\u00e9"', b"0"),
    ]


def test_keys_with_escapes_match_by_their_decoded_text(impl: Any) -> None:
    scan, _ = impl
    doc = b'{"\\ud83d\\ude00":1,"\\ud800":2,"a\\/b":3,"\\"":4,"\\u0041":5}'
    names = ("\U0001f600".encode(), b"a/b", b'"', b"A", b"\xed\xa0\x80")
    _, _, _, _, hits = scan(doc, 0, len(doc), 64, names)
    assert [hits[i] for i in range(0, len(hits), 5)] == [0, 1, 2, 3]  # an unpaired surrogate matches nothing


def test_too_many_hits_are_refused(impl: Any) -> None:
    scan, _ = impl
    doc = b"{" + b",".join([b'"a":1'] * MAX_HITS) + b"}"
    assert len(scan(doc, 0, len(doc), 64, (b"a",))[4]) == 5 * MAX_HITS
    doc = b"{" + b",".join([b'"a":1'] * (MAX_HITS + 1)) + b"}"
    assert scan(doc, 0, len(doc), 64, (b"a",))[0] == TOO_MANY
    assert scan(doc, 0, len(doc), 64, (b"b",))[0] == 1  # keys nobody asked for are not counted
    with pytest.raises(ValueError):
        scan(doc, 0, len(doc), 64, tuple(b"k%d" % i for i in range(17)))


def test_spans_of_a_larger_document(impl: Any) -> None:
    scan, elements = impl
    doc = b'{"messages": [ {"role":"user"} , 7, [], "s" ], "m": {"a": {"b": 1}, "b": 2}}'
    _, _, _, _, hits = scan(doc, 0, len(doc), 64, (b"messages", b"m"))
    ms, me, os_, oe = hits[3], hits[4], hits[8], hits[9]
    spans = elements(doc, ms, me, 10)
    assert [doc[spans[i] : spans[i + 1]] for i in range(0, len(spans), 2)] == [b'{"role":"user"}', b"7", b"[]", b'"s"']
    assert elements(doc, ms, me, 2) == spans[:4]
    assert elements(doc, ms, me, 0) == []
    status, start, end, last, hits = scan(doc, os_, oe, 64, (b"b",))
    assert (status, doc[start:end], doc[last:end]) == (2, doc[os_:oe], b"}")
    assert [doc[hits[i + 3] : hits[i + 4]] for i in range(0, len(hits), 5)] == [b"2"]  # not the nested "b"


def test_large_inputs_scan_without_building_objects(impl: Any) -> None:
    scan, _ = impl
    doc = b'{"a":[' + b",".join([b"{}"] * 200_000) + b'],"b":"' + b"x" * 300_000 + b'"}'
    status, start, end, _, hits = scan(doc, 0, len(doc), 128, (b"b",))
    assert (status, start, end) == (3, 0, len(doc))
    assert hits[3:5] == [len(doc) - 300_003, len(doc) - 1]
    bad = doc[:-300_000] + b"\x01" + doc[-299_999:]
    assert scan(bad, 0, len(bad), 128, ())[0] == INVALID


# -- generated documents ----------------------------------------------------------------------

KEYS = st.sampled_from(["a", "b", "model", "nvext", "é", "\n", "\U0001f600", "", 'k"ey'])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=20,
)
FORMATS = st.fixed_dictionaries(
    {
        "indent": st.sampled_from([None, 0, 2, "\t"]),
        "ensure_ascii": st.booleans(),
        "separators": st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\r\n")]),
    }
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=VALUES, fmt=FORMATS)
def test_generated_documents_scan_like_json_reads_them(impl: Any, value: Any, fmt: dict[str, Any]) -> None:
    scan, elements = impl
    doc = json.dumps(value, **fmt).encode()
    status, start, end, last, hits = scan(doc, 0, len(doc), 64, (b"a", b"model", "é".encode()))
    assert status == depth_of(value)
    assert (start, end) == (0, len(doc))
    if isinstance(value, dict):
        want = [(k, v) for k, v in json.loads(doc, object_pairs_hook=list) if k in ("a", "model", "é")]
        got = [
            (
                json.loads(doc[hits[i + 1] : hits[i + 2]]),
                json.loads(doc[hits[i + 3] : hits[i + 4]], object_pairs_hook=list),
            )
            for i in range(0, len(hits), 5)
        ]
        assert got == want
    if isinstance(value, (dict, list)):
        assert doc[last:end].strip(b" \t\n\r") in (b"}", b"]")
    if isinstance(value, list):
        spans = elements(doc, start, end, MAX_HITS)
        assert [json.loads(doc[spans[i] : spans[i + 1]]) for i in range(0, len(spans), 2)] == value[:MAX_HITS]


MUTATIONS = st.sampled_from(
    [
        b"{",
        b"}",
        b"[",
        b"]",
        b",",
        b":",
        b'"',
        b"\\",
        b" ",
        b"0",
        b"-",
        b"e",
        b".",
        b"\x00",
        b"\x1f",
        b"\x80",
        b"\xc3",
        b"\xff",
        b"t",
        b"n",
        b"u",
    ]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    value=VALUES,
    fmt=FORMATS,
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 2), MUTATIONS), min_size=1, max_size=3),
)
def test_mutated_documents_agree_with_the_reference(
    impl: Any, value: Any, fmt: dict[str, Any], edits: list[tuple[int, int, bytes]]
) -> None:
    scan, _ = impl
    doc = json.dumps(value, **fmt).encode()
    for at, op, byte in edits:
        at %= len(doc) + 1
        doc = doc[:at] + (b"" if op == 0 else byte) + doc[at + (op < 2) :]  # delete, replace, insert
    valid = scan(doc, 0, len(doc), 1000, ())[0] >= 0
    assert valid == reference_valid(doc), doc
    assert valid or not orjson_valid(doc), doc  # orjson accepts a subset


TOKENS = st.sampled_from(
    [
        b"{",
        b"}",
        b"[",
        b"]",
        b",",
        b":",
        b'"a"',
        b'"\\u00e9"',
        b"1",
        b"-2.5e3",
        b"true",
        b"null",
        b" ",
        b"\n",
        b"0",
        b".",
        b'"',
        b"x",
        b"\xc3\xa9",
    ]
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.lists(TOKENS, max_size=14))
def test_token_soup_agrees_with_the_reference(impl: Any, tokens: list[bytes]) -> None:
    scan, _ = impl
    doc = b"".join(tokens)
    assert (scan(doc, 0, len(doc), 1000, ())[0] >= 0) == reference_valid(doc), doc


@pytest.mark.skipif(_compiled is None, reason="the C scanner is compiled only")
@settings(max_examples=300, deadline=None)
@given(value=VALUES, fmt=FORMATS, cut=st.integers(0, 10**6))
def test_c_and_python_scanners_agree_on_spans(value: Any, fmt: dict[str, Any], cut: int) -> None:
    doc = json.dumps(value, **fmt).encode()
    doc = doc[: cut % (len(doc) + 1)] if cut % 3 == 0 else doc
    names = (b"a", b"b", b"model")
    assert _compiled.scan(doc, 0, len(doc), 64, names) == jsonscan.scan_py(doc, 0, len(doc), 64, names)


ASSEMBLERS = [pytest.param(jsonscan.assemble_py, id="python")]
if _compiled is not None:
    ASSEMBLERS.append(pytest.param(_compiled.assemble, id="c"))


@pytest.mark.parametrize("assemble", ASSEMBLERS)
def test_assemble_applies_sorted_edits(assemble: Callable[..., bytes]) -> None:
    data = b"0123456789"
    assert assemble(data, []) == data
    assert (
        assemble(data, [(0, 0, b"<"), (3, 5, b""), (5, 5, b"+"), (9, 10, b"NINE"), (10, 10, b">")]) == b"<012+5678NINE>"
    )
    big = b"x" * 300_000
    assert assemble(big, [(100, 200, b"y" * 5)]) == big[:100] + b"y" * 5 + big[200:]
    for bad in ([(5, 6, b""), (4, 5, b"")], [(5, 4, b"")]):
        with pytest.raises(ValueError):
            assemble(data, bad)


JOINERS = [pytest.param(jsonscan.join_py, id="python")]
if _compiled is not None:
    JOINERS.append(pytest.param(_compiled.join, id="c"))


@pytest.mark.parametrize("join", JOINERS)
def test_join_concatenates(join: Callable[..., bytes]) -> None:
    chunks = [b"a", b"", b"bc", b"x" * 200_000, b"d"]
    assert join(chunks) == b"".join(chunks)
    assert join([]) == b""


SERIALIZERS = [pytest.param(jsonscan.members_json_py, id="python")]
if _compiled is not None:
    SERIALIZERS.append(pytest.param(_compiled.members_json, id="c"))
# The pure-Python members_json is orjson's output cut: held to orjson, only the C writer can differ.
C_SERIALIZER = [pytest.param(_compiled.members_json if _compiled is not None else None, id="c")]
needs_c = pytest.mark.skipif(_compiled is None, reason="the C members writer is compiled only")

# What body patches carry (ids, action words, timeouts) and what the C writer hands to orjson.
MEMBER_VALUES = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127), max_size=300),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def _orjson_members(values: Any) -> bytes | str:
    try:
        return orjson.dumps(values)[1:-1]
    except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
        return f"error: {exc}"


def _members(serialize: Callable[[Any], bytes], values: Any) -> bytes | str:
    try:
        return serialize(values)
    except TypeError as exc:
        return f"error: {exc}"


@needs_c
@pytest.mark.parametrize("serialize", C_SERIALIZER)
def test_members_json_writes_what_orjson_writes(serialize: Callable[[Any], bytes]) -> None:
    cases: list[Any] = [
        {},
        {"session_id": "00000000-bench-4000-8000-000000000001", "action": "bind", "timeout": 300},
        {"session_id": "s", "action": "close"},
        {"a": -(2**63), "b": 2**63 - 1, "c": 2**63, "d": 2**64 - 1, "e": 0, "f": -1},
        {"t": True, "f": False, "n": None, "x": 1.5},
        {"q": 'say "hi"', "b": "back\\slash", "c": "tab\there", "n": "nl\n", "z": "\x00\x1f\x7f"},
        {"u": "é", "e": "🙂", "k": "a" * 2000, "é": 1},
        {"list": [1, "a"], "obj": {"x": {"y": None}}},
        {"s" * 600: "v" * 600},  # past the C writer's buffer: orjson's
    ]
    for values in cases:
        assert _members(serialize, values) == _orjson_members(values), values


@pytest.mark.parametrize("serialize", SERIALIZERS)
def test_members_json_writes_members_without_braces(serialize: Callable[[Any], bytes]) -> None:
    assert serialize({}) == b""
    control = {"session_id": "s-1", "action": "bind", "timeout": 300}
    assert serialize(control) == b'"session_id":"s-1","action":"bind","timeout":300'
    assert serialize({"a": -12, "b": True, "c": None, "q": 'x"y'}) == b'"a":-12,"b":true,"c":null,"q":"x\\"y"'


@pytest.mark.parametrize("serialize", SERIALIZERS)
def test_members_json_keeps_orjsons_errors(serialize: Callable[[Any], bytes]) -> None:
    for values in ({1: "int key"}, {"k": {1, 2}}, {"k": 2**64}, {"k": "\ud800"}, {"k": object()}):
        with pytest.raises(TypeError):
            serialize(values)
        assert _members(serialize, values) == _orjson_members(values)


@needs_c
@pytest.mark.parametrize("serialize", C_SERIALIZER)
@settings(max_examples=300, deadline=None)
@given(values=st.dictionaries(st.text(max_size=12), MEMBER_VALUES, max_size=6))
def test_generated_members_match_orjson(serialize: Callable[[Any], bytes], values: dict[str, Any]) -> None:
    assert _members(serialize, values) == _orjson_members(values)
