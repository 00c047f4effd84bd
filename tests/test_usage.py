"""The usage reader (sidecar.usage) on hand-built and real (Dynamo 1.6.1) response bodies: every
format, streamed and not, with and without usage, malformed, chunked, and every way an engine may
hand it the body's two ends: split into first and last windows at every byte of the usage event,
reads cut at every byte, consecutive tail reads, windows with a gap between them."""

from __future__ import annotations

import random
from collections.abc import Iterator

import orjson
import pytest

from sidecar.usage import (
    FIRST_BYTES,
    LAST_BYTES,
    MAX_USAGE_BYTES,
    Usage,
    UsageOutcome,
    UsageReader,
    find_usage,
    interpret,
)
from tests import usage_samples as s

REPORTED, MISSING = UsageOutcome.REPORTED, UsageOutcome.MISSING
NO_CACHED, MALFORMED, UNREADABLE = UsageOutcome.NO_CACHED_COUNT, UsageOutcome.MALFORMED, UsageOutcome.UNREADABLE


def reported(prompt: int, cached: int) -> Usage:
    return Usage(REPORTED, prompt, cached)


# (name, body, stream, expected): every format, streamed and not, with and without usage.
CASES: list[tuple[str, bytes, bool, Usage]] = [
    *(
        (name, getattr(s, name), b"data:" in getattr(s, name), reported(*counts))
        for name, counts in s.DYNAMO_COUNTS.items()
    ),
    ("dynamo chat stream without include_usage", s.DYNAMO_CHAT_STREAM_NO_USAGE, True, Usage(MISSING)),
    ("chat json", s.chat_json(s.chat_usage(100, 64)), False, reported(100, 64)),
    ("chat json without usage", s.chat_json(), False, Usage(MISSING)),
    ("chat json, vLLM without prompt details", s.chat_json(s.chat_usage(100, None)), False, Usage(NO_CACHED)),
    ("chat stream", s.chat_stream(s.chat_usage(90, 80)), True, reported(90, 80)),
    (
        "chat stream, SGLang's null usage chunks",
        s.chat_stream(s.chat_usage(90, 32), null_usage=True),
        True,
        reported(90, 32),
    ),
    (
        "chat stream, SGLang without cache report",
        s.chat_stream(s.chat_usage(90, None), null_usage=True),
        True,
        Usage(NO_CACHED),
    ),
    ("chat stream without usage", s.chat_stream(null_usage=True), True, Usage(MISSING)),
    ("responses json", orjson.dumps(s.responses_object(s.responses_usage(300, 256))), False, reported(300, 256)),
    ("responses json without usage", orjson.dumps(s.responses_object(None)), False, Usage(MISSING)),
    ("responses stream", s.responses_stream(s.responses_usage(300, 128)), True, reported(300, 128)),
    ("responses stream without details", s.responses_stream(s.responses_usage(300, None)), True, Usage(NO_CACHED)),
    ("anthropic json", s.anthropic_json(s.anthropic_usage(20, 1000, 30)), False, reported(1050, 1000)),
    (
        "anthropic json, no cache fields",
        s.anthropic_json({"input_tokens": 20, "output_tokens": 3}),
        False,
        Usage(NO_CACHED),
    ),
    (
        "anthropic stream, counts in message_start only",
        s.anthropic_stream(s.anthropic_usage(12, 400, 0), {"output_tokens": 9}),
        True,
        reported(412, 400),
    ),
    (
        "anthropic stream, cumulative message_delta",
        s.anthropic_stream(s.anthropic_usage(12, 400, 0), s.anthropic_usage(12, 400, 8)),
        True,
        reported(420, 400),
    ),
    (
        "anthropic stream, message_start without cache read",
        s.anthropic_stream(s.anthropic_usage(500, None, 0), {"output_tokens": 9}),
        True,
        Usage(NO_CACHED),
    ),
]


def spans(payload: bytes) -> list[range]:
    """Where the usage events are: the first and last usage member whose value is an object,
    each from the start of its event (or member) to its end, a few bytes wider."""
    keys = []
    at = payload.find(b'"usage":{')
    while at >= 0:
        keys.append(at)
        at = payload.find(b'"usage":{', at + 1)
    out = []
    for key in dict.fromkeys(keys[:1] + keys[-1:]):
        begin = payload.rfind(b"\n\n", 0, key)
        end = payload.find(b"\n\n", key)
        if b"data:" not in payload:  # a JSON body: the member
            begin, end = key, payload.find(b"}}", key) + 2
        out.append(range(max(begin - 4, 0), min((end if end >= 0 else len(payload)) + 6, len(payload) + 1)))
    return out or [range(max(len(payload) - 64, 0), len(payload) + 1)]


def raw_index(raw: bytes) -> list[int]:
    """For a chunked body: the raw offset of each payload byte (and one past the last)."""
    out, at = [], 0
    while True:
        line_end = raw.index(b"\r\n", at)
        size = int(raw[at:line_end], 16)
        if size == 0:
            return out + [line_end]
        out.extend(range(line_end + 2, line_end + 2 + size))
        at = line_end + 2 + size + 2


def positions(payload: bytes, raw: bytes, chunked: bool) -> Iterator[int]:
    """Every raw offset of every usage event of ``payload`` (as ``raw`` frames it)."""
    index = raw_index(raw) if chunked else None
    seen: set[int] = set()
    for span in spans(payload):
        lo = span.start if index is None else index[span.start]
        hi = span.stop if index is None else index[min(span.stop, len(index) - 1)] + 1
        for p in range(lo, min(hi, len(raw)) + 1):
            if p not in seen:
                seen.add(p)
                yield p


def complement(raw: bytes, p: int, chunked: bool, stream: bool) -> Usage:
    """The engine handed the body's first ``p`` bytes as its first reads and the rest as its
    last bytes."""
    reader = UsageReader(chunked, stream)
    reader.first(raw[:p])
    reader.last(raw[p:], len(raw))
    return reader.result()


def reads_cut(raw: bytes, p: int, chunked: bool, stream: bool) -> Usage:
    """Two reads cut at ``p``: both shown to first() until it is done; the last LAST_BYTES to last()."""
    reader = UsageReader(chunked, stream)
    if not reader.first(raw[:p]):
        reader.first(raw[p:])
    reader.last(raw[-LAST_BYTES:], len(raw))
    return reader.result()


def tail_reads(raw: bytes, p: int, chunked: bool, stream: bool) -> Usage:
    """Reads of 40 bytes to first() until it is done; the tail as consecutive reads cut at ``p``."""
    reader = UsageReader(chunked, stream)
    at = 0
    while at < len(raw) and not reader.first(raw[at : at + 40]):
        at += 40
    q = max(p - 700, 0)
    reader.last(raw[q:p], p)
    reader.last(raw[p:], len(raw))
    return reader.result()


FRAMINGS = ["plain", "chunked per event", "chunked 7/64/1"]


def framed(body: bytes, framing: str) -> tuple[bytes, bool]:
    if framing == "plain":
        return body, False
    if framing == "chunked per event":
        return (s.chunked_by_event(body) if b"data:" in body else s.chunked(body, [97])), True
    return s.chunked(body, [7, 64, 1]), True


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize(("name", "body", "stream", "expected"), CASES, ids=[c[0] for c in CASES])
def test_usage_at_every_split_of_the_usage_event(name, body, stream, expected, framing):
    raw, chunked = framed(body, framing)
    assert find_usage(body) == expected
    whole = UsageReader(chunked, stream)
    whole.first(raw)
    whole.last(raw, len(raw))
    assert whole.result() == expected
    for p in positions(body, raw, chunked):
        for feed in (complement, reads_cut, tail_reads):
            got = feed(raw, p, chunked, stream)
            assert got == expected, f"{feed.__name__} at {p} of {len(raw)}: {got}"


def test_reads_of_one_byte():
    """A reader fed the whole body byte by byte, first and last alike."""
    body = s.DYNAMO_MESSAGES_STREAM
    for raw, chunked in (framed(body, "plain"), framed(body, "chunked 7/64/1")):
        reader = UsageReader(chunked, True)
        for i in range(len(raw)):
            if reader.first(raw[i : i + 1]):
                break
        for i in range(len(raw)):
            reader.last(raw[i : i + 1], i + 1)
        assert reader.result() == reported(720, 704)


# -- bodies longer than both windows -------------------------------------------------------------


def long_cases() -> list[tuple[str, bytes, bool, Usage]]:
    text = "token " * 12
    return [
        ("chat stream", s.chat_stream(s.chat_usage(5000, 4096), words=2000, text=text), True, reported(5000, 4096)),
        ("chat stream without usage", s.chat_stream(words=2000, text=text), True, Usage(MISSING)),
        # the completed event carries the whole output: its usage member is found cut from its event's start
        (
            "responses stream",
            s.responses_stream(s.responses_usage(900, 512), deltas=3000, text=text),
            True,
            reported(900, 512),
        ),
        (
            "anthropic stream, counts in message_start only",
            s.anthropic_stream(s.anthropic_usage(10, 8000, 90), {"output_tokens": 2000}, deltas=2000, text=text),
            True,
            reported(8100, 8000),
        ),
        ("chat json", s.chat_json(s.chat_usage(700, 512), text=text * 1000), False, reported(700, 512)),
        # Dynamo's Responses JSON puts `instructions` after `usage`: past both windows, not found
        (
            "responses json, usage far from both ends",
            orjson.dumps(
                {
                    "id": "r",
                    "output": [{"text": text * 1000}],
                    "usage": s.responses_usage(5, 1),
                    "instructions": "x" * 40_000,
                }
            ),
            False,
            Usage(MISSING),
        ),
    ]


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize(("name", "body", "stream", "expected"), long_cases(), ids=[c[0] for c in long_cases()])
def test_long_bodies_are_read_from_their_two_ends_only(name, body, stream, expected, framing):
    raw, chunked = framed(body, framing)
    assert len(raw) > FIRST_BYTES + LAST_BYTES
    reader = UsageReader(chunked, stream)
    at, n, step = 0, 0, 1500
    while at < len(raw):  # reads as they come; the first ones until first() is done
        read = raw[at : at + step]
        at += len(read)
        n += 1
        if reader.first(read):
            break
    assert n <= FIRST_BYTES // step + 1
    reader.last(raw[-LAST_BYTES - 5000 :], len(raw))  # more than kept: only LAST_BYTES are
    assert len(reader._head) <= FIRST_BYTES and reader._tail is not None and len(reader._tail) <= LAST_BYTES
    assert reader.result() == expected
    for p in range(len(raw) - 900, len(raw) + 1, 7):  # the tail as two consecutive reads cut anywhere
        assert tail_reads(raw, p, chunked, stream) == expected


def test_a_streams_first_event_ends_the_first_reads():
    body = s.anthropic_stream(s.anthropic_usage(1, 2, 3), {"output_tokens": 1})
    first_event = body.index(b"\n\n") + 2
    reader = UsageReader(False, True)
    assert not reader.first(body[: first_event - 1])
    assert reader.first(body[first_event - 1 : first_event + 3])
    json_reader = UsageReader(False, False)
    assert not json_reader.first(s.chat_json(s.chat_usage(1, 1)))  # a JSON body: up to FIRST_BYTES
    assert json_reader.first(b" " * FIRST_BYTES)


# -- malformed and misleading usage ---------------------------------------------------------------


MALFORMED_USAGES = [
    {"prompt_tokens": -1, "prompt_tokens_details": {"cached_tokens": 0}},
    {"prompt_tokens": "12", "prompt_tokens_details": {"cached_tokens": 0}},
    {"prompt_tokens": 12.0, "prompt_tokens_details": {"cached_tokens": 0}},
    {"prompt_tokens": True, "prompt_tokens_details": {"cached_tokens": 0}},
    {"prompt_tokens": None, "prompt_tokens_details": {"cached_tokens": 0}},
    {"prompt_tokens": 12, "prompt_tokens_details": {"cached_tokens": 13}},  # cached above prompt
    {"prompt_tokens": 12, "prompt_tokens_details": {"cached_tokens": -3}},
    {"prompt_tokens": 12, "prompt_tokens_details": "all"},
    {"prompt_tokens": 2**60, "prompt_tokens_details": {"cached_tokens": 0}},
    {"input_tokens": 5, "input_tokens_details": {"cached_tokens": "5"}},
    {"input_tokens": 5, "cache_read_input_tokens": -1},
    {"input_tokens": "5", "cache_read_input_tokens": 1},
    {"input_tokens": 5, "cache_read_input_tokens": 1, "cache_creation_input_tokens": "x"},
]


@pytest.mark.parametrize("usage", MALFORMED_USAGES, ids=range(len(MALFORMED_USAGES)))
def test_malformed_counts_are_unknown_never_zero(usage):
    assert interpret(usage) == Usage(MALFORMED)
    for body, stream in ((s.chat_json(usage), False), (s.chat_stream(usage), True)):
        for p in positions(body, body, False):
            assert complement(body, p, False, stream) == Usage(MALFORMED)


@pytest.mark.parametrize(
    "member",
    [
        b'"usage":"lots"',
        b'"usage":[1,2]',
        b'"usage":12',
        b'"usage":{"prompt_tokens":12,,"prompt_tokens_details":{"cached_tokens":1}}',
        b'"usage":{"prompt_tokens":12 "x":1}',
        b'"usage":{"prompt_tokens":12,"pad":"' + b"x" * MAX_USAGE_BYTES + b'"}',
    ],
)
def test_a_usage_member_that_is_not_counts_is_malformed(member):
    body = b'{"id":"x","choices":[],' + member + b"}"
    assert find_usage(body) == Usage(MALFORMED)
    stream = b'data: {"choices":[],' + member + b"}\n\ndata: [DONE]\n\n"
    assert find_usage(stream) == Usage(MALFORMED)


def test_usage_named_inside_strings_is_not_usage():
    fake = '"usage": {"prompt_tokens": 99, "prompt_tokens_details": {"cached_tokens": 99}}'
    assert find_usage(s.chat_json(None, text=fake)) == Usage(MISSING)
    assert find_usage(s.chat_json(s.chat_usage(10, 2), text=fake)) == reported(10, 2)
    assert find_usage(s.chat_stream(None, text=fake)) == Usage(MISSING)
    assert find_usage(b'{"note":"usage","usage_x":{"prompt_tokens":1}}') == Usage(MISSING)
    assert find_usage(b'{"k\\"usage":{"prompt_tokens":4,"prompt_tokens_details":{"cached_tokens":4}}}') == Usage(
        MISSING
    )


def test_usage_that_says_nothing_of_the_prompt_is_passed_over():
    assert interpret({"output_tokens": 5}) is None
    assert interpret({"completion_tokens": 5}) is None
    assert find_usage(b'{"usage":{"output_tokens":5}}') == Usage(MISSING)
    body = s.chat_stream(s.chat_usage(40, 8)) + b'data: {"usage":{"output_tokens":3}}\n\ndata: {"usage":null}\n\n'
    assert find_usage(body) == reported(40, 8)


def test_the_last_reported_counts_win():
    body = s.chat_stream(s.chat_usage(40, 8)) + s.sse({"choices": [], "usage": s.chat_usage(41, 9)})
    assert find_usage(body) == reported(41, 9)
    # an earlier member that reported counts beats a later one that did not
    body = s.chat_stream(s.chat_usage(40, 8)) + s.sse({"choices": [], "usage": s.chat_usage(41, None)})
    assert find_usage(body) == reported(40, 8)


def test_anthropic_prompt_counts_every_input_part():
    assert interpret(s.anthropic_usage(5, 100, 20)) == reported(125, 100)
    assert interpret({"input_tokens": 5, "cache_read_input_tokens": 7}) == reported(12, 7)
    assert interpret(
        {"input_tokens": 5, "cache_read_input_tokens": 7, "cache_creation_input_tokens": None}
    ) == reported(12, 7)
    assert interpret({"input_tokens": 5, "cache_creation_input_tokens": 7}) == Usage(NO_CACHED)


# -- what cannot be read --------------------------------------------------------------------------


def test_a_body_cut_before_its_usage_is_missing():
    body = s.chat_stream(s.chat_usage(10, 5))
    cut = body[: body.index(b'"usage"') + 20]
    reader = UsageReader(False, True)
    reader.first(cut)
    reader.last(cut, len(cut))
    assert reader.result() == Usage(MISSING)


def test_framing_that_cannot_be_followed_is_unreadable():
    """Bytes said to be chunked are read as they are first; framing is followed only when a
    usage member does not parse, and bytes that are not chunked framing are then unreadable."""
    body = s.chat_stream(s.chat_usage(10, 5))
    reader = UsageReader(True, True)
    reader.first(body)
    reader.last(body, len(body))
    assert reader.result() == reported(10, 5)  # its members parse as they are
    at = body.index(b'"prompt_tokens_details"')
    broken = body[:at] + b"\r\nzz\r\n" + body[at:]
    for first, tail_from in ((broken, 0), (broken[:100], len(broken) - LAST_BYTES // 4)):
        reader = UsageReader(True, True)
        reader.first(first)
        reader.last(broken[max(tail_from, 0) :], len(broken) + (FIRST_BYTES if tail_from else 0))
        assert reader.result() == Usage(UNREADABLE)


def test_a_usage_key_cut_by_framing_is_found():
    body = s.chat_stream(s.chat_usage(33, 22))
    key = body.index(b'"usage"')
    for cut in range(key, key + len(b'"usage":{') + 1):
        raw = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (cut, body[:cut], len(body) - cut, body[cut:])
        for p in (0, cut, len(raw) - 20):
            assert complement(raw, p, True, True) == reported(33, 22), (cut, p)


def test_chunk_extensions_and_trailers_are_framing():
    body = s.chat_stream(s.chat_usage(10, 5))
    half = len(body) // 2
    raw = b"%x;name=v\r\n%s\r\n%x\r\n%s\r\n0;x\r\nTrailer: 1\r\n\r\n" % (
        half,
        body[:half],
        len(body) - half,
        body[half:],
    )
    for p in range(0, len(raw), 3):
        assert complement(raw, p, True, True) == reported(10, 5)


def test_nothing_fed_is_missing():
    assert UsageReader(False, True).result() == Usage(MISSING)
    reader = UsageReader(True, False)
    reader.last(b"", 0)
    assert reader.result() == Usage(MISSING)


def test_random_reads_and_chunkings_agree():
    rng = random.Random(46)
    for name, body, stream, expected in CASES:
        for _ in range(20):
            sizes = [rng.randint(1, 300) for _ in range(rng.randint(1, 5))]
            raw = s.chunked(body, sizes)
            reader = UsageReader(True, stream)
            at = 0
            while at < len(raw):
                n = rng.randint(1, 400)
                done = reader.first(raw[at : at + n])
                at += n
                if done:
                    break
            # the last bytes: at least LAST_BYTES, or all after those first() got
            cut = rng.randint(0, max(min(at, len(raw)), len(raw) - LAST_BYTES))
            reader.last(raw[cut:], len(raw))
            assert reader.result() == expected, (name, sizes, cut)


def test_last_reads_keeps_the_body_end_of_consecutive_reads():
    """An engine's last reads (oldest first, None where it has none) are the body's last bytes:
    joined, at most LAST_BYTES of them, without the bytes that followed the body."""
    body = s.chat_stream(s.chat_usage(300, 256), words=2000)
    reads = [body[i : i + 100] for i in range(0, len(body), 100)]
    reader = UsageReader(False, True)
    reader.first(reads[0])
    reader.last_reads([None, None, *reads[-6:]], len(body))
    assert reader.result() == Usage(UsageOutcome.REPORTED, 300, 256)
    # a last read with bytes after the body: not kept
    reader = UsageReader(False, True)
    reader.first(reads[0])
    reader.last_reads([*reads[-8:-1], reads[-1] + b"HTTP/1.1 200 OK\r\n"], len(body) + 17, 17)
    assert reader._tail is not None and body.endswith(reader._tail)
    assert reader.result() == Usage(UsageOutcome.REPORTED, 300, 256)
    # only what covers LAST_BYTES is copied
    big = [b"x" * 10000, b"y" * 10000, b"z" * 10000]
    reader = UsageReader(False, False)
    reader.last_reads(big, 30000)
    assert reader._tail == b"y" * (LAST_BYTES - 10000) + b"z" * 10000
