"""The compiled usage reader's C reads (sidecar/_usagescan.pxd) against its Python source.

Compiled, sidecar.usage finds the usage key, reads its object and looks for keys cut by chunked
framing in C, where it can tell; the same source run as Python is the reference: on generated
usage objects (every field server send, and values of every JSON kind where counts go),
their bytes mutated at random, wrapped as JSON bodies, events and chunked streams, the two must
give the same answer. In the pure-Python build there is nothing to compare: skipped there.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import pytest

import sidecar.usage as compiled
from sidecar.compiled import is_compiled

pytestmark = pytest.mark.skipif(not is_compiled(compiled), reason="the pure-Python build has no C reads")


def _python_source() -> ModuleType:
    """sidecar/usage.py run from its source, as its own module (the reference)."""
    path = Path(compiled.__file__).with_name("usage.py")
    spec = importlib.util.spec_from_file_location("sidecar_usage_source", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclass-free, but enum and annotations resolve through it)
    spec.loader.exec_module(module)
    return module


source = _python_source()


def answer(usage: Any) -> tuple[str, int, int] | None:
    """A Usage of either module as plain values (each has its own classes)."""
    return None if usage is None else (usage.outcome.value, usage.prompt_tokens, usage.cached_tokens)


COUNT_KEYS = ["prompt_tokens", "input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"]
DETAILS_KEYS = ["prompt_tokens_details", "input_tokens_details"]
OTHER_KEYS = ["completion_tokens", "total_tokens", "output_tokens", "service_tier", "cache_creation", "server_tool_use"]
RAW_VALUES = [
    b"0", b"7", b"726", b"999999999999999", b"1000000000000000", b"9007199254740991", b"9007199254740992",
    b"123456789012345678901", b"-1", b"-0", b"01", b"1.5", b"2.0", b"1e3", b"1E+2", b"0.5e-1", b"null", b"true",
    b"false", b'"704"', b'"a\\"b"', b'"\\u0041"', b'"caf\xc3\xa9"', b'"}"', b"[]", b"[1,{\"a\":2}]", b"{}",
]  # fmt: skip
WS = [b"", b" ", b"\n  ", b"\t", b"\r\n"]


def gen_value(rng: random.Random, depth: int) -> bytes:
    if depth < 3 and rng.random() < 0.15:
        return gen_object(rng, depth + 1, rng.random() < 0.5)
    return rng.choice(RAW_VALUES)


def gen_object(rng: random.Random, depth: int, details: bool) -> bytes:
    """A JSON object of usage's fields (``details``: of a details object's) with values of every
    kind, repeated keys now and then, whitespace anywhere JSON allows it."""
    keys = ["cached_tokens", "audio_tokens", "reasoning_tokens"] if details else COUNT_KEYS + DETAILS_KEYS + OTHER_KEYS
    members = []
    for _ in range(rng.randint(0, 6)):
        key = rng.choice(keys)
        if key in DETAILS_KEYS and rng.random() < 0.7:
            value = gen_object(rng, depth + 1, True)
        elif key in ("cached_tokens", *COUNT_KEYS) and rng.random() < 0.6:
            value = b"%d" % rng.choice([0, 1, 40, 704, 726, 10**15 - 1, 2**53 - 1])
        else:
            value = gen_value(rng, depth)
        w = [rng.choice(WS) for _ in range(4)]
        members.append(w[0] + b'"' + key.encode() + b'"' + w[1] + b":" + w[2] + value + w[3])
    return b"{" + b",".join(members) + rng.choice(WS) + b"}"


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One random change of a byte: deleted, inserted or replaced (JSON's punctuation mostly)."""
    if not data:
        return data
    at = rng.randrange(len(data))
    byte = bytes([rng.choice(b'{}[]",:0123456789-.e \\nulg\r\n\x00\xff')])
    return rng.choice([data[:at] + data[at + 1 :], data[:at] + byte + data[at:], data[:at] + byte + data[at + 1 :]])


COUNTS = [0, 1, 40, 704, 726, 10**15 - 1, 2**53 - 1]


def gen_shape(rng: random.Random) -> bytes:
    """A usage object as a server sends it (OpenAI chat, Responses, Anthropic), of random counts
    (equal ones too), a member left out or null now and then, with other members around."""

    def count() -> bytes:
        return rng.choice([b"%d" % rng.choice(COUNTS)] * 8 + [b"null", b"1.0", b'"3"'])

    shape = rng.choice(["chat", "responses", "anthropic"])
    if shape == "anthropic":
        fields = [("input_tokens", count()), ("cache_read_input_tokens", count()),
                  ("cache_creation_input_tokens", count()), ("output_tokens", count()),
                  ("service_tier", b'"standard"'), ("cache_creation", b'{"ephemeral_5m_input_tokens":0}')]  # fmt: skip
    else:
        prompt = "prompt_tokens" if shape == "chat" else "input_tokens"
        details = b'{"cached_tokens":%s,"audio_tokens":0}' % count()
        fields = [(prompt, count()), (prompt + "_details", rng.choice([details] * 6 + [b"null", b"[]", b"{}"])),
                  ("completion_tokens", count()), ("total_tokens", count())]  # fmt: skip
    rng.shuffle(fields)
    kept = [f for f in fields if rng.random() < 0.9]
    return b"{" + b",".join(b'"%s":%s' % (k.encode(), v) for k, v in kept) + b"}"


def usage_objects(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        obj = gen_shape(rng) if rng.random() < 0.5 else gen_object(rng, 0, False)
        for _ in range(rng.choice([0, 0, 1, 2])):
            obj = mutate(rng, obj)
        out.append(obj)
    return out


def test_the_generated_objects_cover_every_outcome() -> None:
    """(The generator reaches each answer the reader can give, valid JSON and not.)"""
    seen = {answer(source.find_usage(b'{"usage":' + obj + b"}"))[0] for obj in usage_objects(3000, 1)}  # type: ignore[index]
    assert seen == {"reported", "missing", "no_cached_count", "malformed"}
    parsed = 0
    for obj in usage_objects(3000, 1):
        try:
            orjson.loads(obj)
            parsed += 1
        except orjson.JSONDecodeError:
            pass
    assert 0.3 < parsed / 3000 < 0.95


@pytest.mark.parametrize("seed", range(4))
def test_a_usage_object_reads_as_the_source_reads_it(seed: int) -> None:
    """In a JSON body, after other members, and in an event, cut short or not."""
    rng = random.Random(seed)
    for obj in usage_objects(4000, 100 + seed):
        for payload in (
            b'{"usage":' + obj + b"}",
            b'{"id":"x","choices":[],"usage":' + rng.choice(WS) + obj + b',"model":"m"}',
            b'data: {"choices":[],"usage":' + obj + b"}\n\ndata: [DONE]\n\n",
            (b'{"usage":' + obj + b"}")[: rng.randrange(8, len(obj) + 11)],  # cut by the window's end
        ):
            for at_start in (True, False):
                want = answer(source.find_usage(payload, at_start))
                assert answer(compiled.find_usage(payload, at_start)) == want, (payload, at_start)


def test_the_last_usage_key_is_found_as_rfind_finds_it() -> None:
    rng = random.Random(7)
    alphabet = [b'"usage"', b"usage", b'"usag', b'sage"', b"g", b'"', b"e", b"xx", b"gg", b'"usage""usage"']
    for _ in range(20000):
        payload = b"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
        end = rng.randint(0, len(payload))
        assert compiled._rfind_key(payload, end) == payload.rfind(b'"usage"', 0, end), (payload, end)


def test_a_key_cut_by_framing_is_suspected_as_the_source_suspects_it() -> None:
    rng = random.Random(11)
    alphabet = [b"\r\n", b"\r", b"\n", b'"us', b"age", b'sage"', b'usage"', b'"usa', b'"usag', b'"usage', b'"usage"',
                b"x" * 40, b"data: {}", b"1a"]  # fmt: skip
    for _ in range(20000):
        raw = b"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        start = rng.randint(0, len(raw))
        assert compiled._may_cut_key(raw, start) == source._may_cut_key(raw, start), (raw, start)


def _chunked(rng: random.Random, payload: bytes) -> bytes:
    """``payload`` in chunks of random sizes (tiny ones included: keys cut by framing), ended."""
    out, at = [], 0
    while at < len(payload):
        size = rng.choice([1, 2, 3, 5, 7, 16, 64, 500])
        out.append(b"%x\r\n%s\r\n" % (len(payload[at : at + size]), payload[at : at + size]))
        at += size
    return b"".join(out) + b"0\r\n\r\n"


@pytest.mark.parametrize("seed", range(3))
def test_a_chunked_stream_reads_as_the_source_reads_it(seed: int) -> None:
    """Streams whose usage event's framing cuts it anywhere, read from the start or from a cut."""
    rng = random.Random(seed)
    for obj in usage_objects(1500, 200 + seed):
        events = b"".join(b'data: {"choices":[{"delta":{"content":"w "}}]}\n\n' for _ in range(rng.randint(0, 30)))
        body = _chunked(rng, events + b'data: {"choices":[],"usage":' + obj + b"}\n\ndata: [DONE]\n\n")
        for raw, at_start in ((body, True), (body[rng.randrange(len(body)) :], False)):
            reader_c, reader_py = compiled.UsageReader(True, True), source.UsageReader(True, True)
            for reader in (reader_c, reader_py):
                if at_start:
                    reader.first(raw)
                reader.last(raw, len(body))  # (from the start: the whole body again)
            assert answer(reader_c.result()) == answer(reader_py.result()), raw
