"""Prompt-cache usage read from a response body without touching it: how many prompt tokens the
upstream processed for a turn and how many of them it found in its prefix cache.

The body is relayed byte for byte; an engine only shows a :class:`UsageReader` a bounded copy
of its first bytes (:meth:`UsageReader.first`) and of its last bytes (:meth:`UsageReader.last`),
as they came from the upstream (with their chunked framing when ``chunked``), cut anywhere. Once
the body ended, :meth:`UsageReader.result` finds the usage and parses only that: nothing runs
per event, and the work and memory of one response are bounded by :data:`FIRST_BYTES`,
:data:`LAST_BYTES` and :data:`MAX_USAGE_BYTES`, whatever the body's size.

What the formats say, and what is read (``prompt`` / ``cached``):

- OpenAI chat completions (and completions): ``usage.prompt_tokens`` /
  ``usage.prompt_tokens_details.cached_tokens``, in the JSON body or, streamed, in the final
  chunk that ``stream_options.include_usage`` asks for (before ``data: [DONE]``). With
  ``continuous_usage_stats`` (vLLM, Dynamo) every chunk carries the counts so far: the last wins.
  SGLang and vLLM send ``prompt_tokens_details: null`` unless started with
  ``--enable-cache-report`` / ``--enable-prompt-tokens-details``, and ``"usage": null`` in the
  chunks before the last.
- OpenAI Responses: ``usage.input_tokens`` / ``usage.input_tokens_details.cached_tokens``, in the
  JSON body or in the ``response`` of the last event (``response.completed``, or
  ``response.incomplete`` / ``response.failed``; Dynamo ends the stream with ``data: [DONE]``).
- Anthropic Messages: ``usage.input_tokens`` counts only the *uncached* part; the prompt is
  ``input_tokens + cache_read_input_tokens + cache_creation_input_tokens`` and ``cached`` is
  ``cache_read_input_tokens`` (tokens written to the cache were processed, not reused). Streamed,
  in ``message_start`` (the first event) and, cumulative, in ``message_delta`` (the last with
  counts); the last one that has them wins. Dynamo's ``message_start`` carries an estimate
  without ``cache_read_input_tokens`` and every ``content_block_delta`` carries the counts so far.

How it is found: the last ``"usage"`` member (a real key: not inside a string) whose value is an
object, in the last bytes first, then in the first bytes; its object (at most
:data:`MAX_USAGE_BYTES`) is the only thing parsed. A member that says nothing of the prompt
(``{"output_tokens": 5}``) or is ``null`` is passed over for an earlier one. A response whose
usage lies more than :data:`LAST_BYTES` before its end and past its first :data:`FIRST_BYTES`
is not found (a Responses JSON body that echoes long ``instructions`` after ``usage``).

The outcome is never a guess: a response without usage is :attr:`UsageOutcome.MISSING`, one
whose prompt count comes without a cached count :attr:`UsageOutcome.NO_CACHED_COUNT`, one whose
counts are not non-negative integers (or cached above prompt) :attr:`UsageOutcome.MALFORMED`,
one whose framing could not be followed :attr:`UsageOutcome.UNREADABLE`: all four are unknown,
never zero. Compiled, the usage key is found and its object read in C where the object is of
the shapes servers send (sidecar/_usagescan.pxd; any other shape is read as above, by
orjson). A leaf: imports nothing of the sidecar but :mod:`sidecar.compiled`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import orjson

from sidecar.compiled import is_compiled

__all__ = [
    "FIRST_BYTES",
    "LAST_BYTES",
    "MAX_USAGE_BYTES",
    "TAIL_READS",
    "MALFORMED",
    "MISSING",
    "NO_CACHED_COUNT",
    "UNREADABLE",
    "Usage",
    "UsageOutcome",
    "UsageReader",
    "find_usage",
    "interpret",
]

# The body bytes a reader keeps of each end (an Anthropic stream's message_start comes first, the
# other formats' usage last).
FIRST_BYTES = 16 * 1024
LAST_BYTES = 16 * 1024
# The reads of a body's end an engine keeps (references, not copies) to show :meth:`UsageReader.last`
# once the body ended: a stream's usage event, its ``[DONE]`` and its last chunk may each come in
# a read of their own, and the usage event itself in a few.
TAIL_READS = 8
# A usage object longer than this is malformed (real ones are a few hundred bytes).
MAX_USAGE_BYTES = 4 * 1024
# Usage members examined per window, from its end (a stream with usage in every event has them
# in every event: the last one with counts is the answer).
MAX_CANDIDATES = 16
# A chunked tail cut anywhere: chunk-size lines tried as the first complete one, and the chunk
# steps those tries may take in all.
MAX_RESYNC_TRIES = 64
MAX_RESYNC_STEPS = 4096
# Where a usage key cut by a chunk's framing is looked for: the last bytes of a window (usage
# members end the last event of every format, a few hundred bytes before the body's end).
KEY_CUT_BYTES = 4 * 1024
# Closing braces a usage object is tried at before its end is scanned for (see _member).
_QUICK_TRIES = 4
_OBJECT_BYTES = MAX_USAGE_BYTES
# Counts above this are not token counts.
MAX_COUNT = 1 << 53


class UsageOutcome(StrEnum):
    """What a response said of its prompt-cache usage; a closed set (a metric label)."""

    REPORTED = "reported"  # prompt and cached prompt tokens
    MISSING = "missing"  # no usage at all
    NO_CACHED_COUNT = "no_cached_count"  # a prompt count without its cached part
    MALFORMED = "malformed"  # a usage member that is not valid counts
    UNREADABLE = "unreadable"  # a body the sidecar could not read (encoded, framing not followed)


class Usage:
    """One response's usage: the counts when ``outcome`` is REPORTED, else 0 (unknown). A value
    (compared and hashed by its fields), never changed once made; compiled, an extension type
    whose fields the request path reads as C fields."""

    __slots__ = ("outcome", "prompt_tokens", "cached_tokens")

    def __init__(self, outcome: UsageOutcome, prompt_tokens: int = 0, cached_tokens: int = 0) -> None:
        self.outcome = outcome
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens

    @property
    def reported(self) -> bool:
        return self.outcome is _REPORTED

    def _key(self) -> tuple[UsageOutcome, int, int]:
        return (self.outcome, self.prompt_tokens, self.cached_tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Usage) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Usage({self.outcome.value!r}, prompt_tokens={self.prompt_tokens}, cached_tokens={self.cached_tokens})"


_REPORTED = UsageOutcome.REPORTED
MISSING = Usage(UsageOutcome.MISSING)
NO_CACHED_COUNT = Usage(UsageOutcome.NO_CACHED_COUNT)
MALFORMED = Usage(UsageOutcome.MALFORMED)
UNREADABLE = Usage(UsageOutcome.UNREADABLE)
# When no member reported counts, the answer is the most telling of what was seen.
_RANK = {
    UsageOutcome.MALFORMED: 3,
    UsageOutcome.NO_CACHED_COUNT: 2,
    UsageOutcome.UNREADABLE: 1,
    UsageOutcome.MISSING: 0,
    UsageOutcome.REPORTED: 0,
}

_KEY = b'"usage"'
_COMPILED = is_compiled(sys.modules[__name__])
# What the bytes hold when a chunk's framing cuts a usage key (or follows it): the longer of its
# two parts, with the framing's CRLF on its side.
_KEY_CUT = tuple(b"\r\n" + _KEY[i:] if i < 3 else _KEY[:i] + b"\r\n" for i in range(1, len(_KEY) + 1))
_HEX = frozenset(b"0123456789abcdefABCDEF")
# What an object scan stops at: quotes, braces, brackets and backslashes.
_SPECIAL = re.compile(rb'["{}\[\]\\]')
_STRING_END = re.compile(rb'["\\]')
# A chunk-size line (extensions ignored; sizes below 2**60, as llhttp's), whole or cut at the end.
_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(?:;[^\r\n]{0,1024})?\r\n")
_SIZE_LINE_CUT = re.compile(rb"[0-9A-Fa-f]{1,15}(?:[ \t]*(?:;[^\r\n]{0,1024})?\r?)?")
# A trailer field line's start: a field name (RFC 9110 token), a colon.
_FIELD = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:")


class UsageReader:
    """The usage of one response body, from bounded copies of its two ends.

    An engine calls :meth:`first` with the body's reads from its start until it returns True,
    :meth:`last` with the body's last bytes once the body ended, then :meth:`result` once.
    ``chunked``: the bytes carry the body's chunked framing; ``stream``: the body is an event
    stream (``text/event-stream``), whose first event is all :meth:`first` needs.
    """

    __slots__ = ("chunked", "stream", "_head", "_head_done", "_tail", "_end")

    def __init__(self, chunked: bool, stream: bool) -> None:
        self.chunked = chunked
        self.stream = stream
        self._head = b""
        self._head_done = False
        self._tail: bytes | None = None
        self._end = 0

    def first(self, data: bytes) -> bool:
        """The next read of the body's beginning (the first call: its first bytes). True once no
        more is wanted: :data:`FIRST_BYTES` were kept, or a stream's first event with data is
        whole. Later calls are ignored."""
        if self._head_done:
            return True
        head = self._head
        room = FIRST_BYTES - len(head)
        if room > 0 and data:
            head = self._head = head + data[:room]
        if len(head) >= FIRST_BYTES:
            self._head_done = True
        elif self.stream:
            self._head_done = _first_event_done(head, self.chunked)
        return self._head_done

    def holds(self, end: int) -> bool:
        """Whether the bytes :meth:`first` kept are the body's first ``end`` bytes (all of
        them): an engine need not keep those reads for :meth:`last` too."""
        return len(self._head) >= end

    def last(self, data: bytes, end: int) -> None:
        """The body's last bytes so far: ``data`` ends at body offset ``end`` (the body's bytes
        as read, framing included, up to and with ``data``'s last one; ``end >= len(data)``).
        Once the body ended; may also be called with consecutive reads (each continuing the
        previous call's), or with a window overlapping what :meth:`first` kept. Only the last
        :data:`LAST_BYTES` are kept."""
        if len(data) > LAST_BYTES:
            data = data[-LAST_BYTES:]
        tail = self._tail
        if tail is not None and end - len(data) == self._end:
            data = tail + data
            if len(data) > LAST_BYTES:
                data = data[-LAST_BYTES:]
        self._tail = data
        self._end = end

    def last_reads(self, reads: Sequence[bytes | None], end: int, extra: int = 0) -> None:
        """:meth:`last` for an engine's last reads as they came, oldest first (None: no read
        there), each continuing the one before; the last ends at body offset ``end``. ``extra``:
        bytes at the end of the last read that followed the body (not kept). Copies at most
        :data:`LAST_BYTES` of them (plus ``extra``)."""
        want = LAST_BYTES + extra
        picked: list[bytes] = []
        n = 0
        for data in reversed(reads):
            if data is None or n >= want:
                break
            if len(data) > want - n:
                data = data[n - want :]
            picked.append(data)
            n += len(data)
        window = picked[0] if len(picked) == 1 else b"".join(reversed(picked))
        if extra:
            window = window[: max(len(window) - extra, 0)]
        if window:
            self.last(window, end - extra)

    def result(self) -> Usage:
        """The response's usage, from what was kept (bounded work: see the module docstring)."""
        head, tail = self._head, self._tail
        if tail is None or self._end - len(tail) <= len(head):  # one window, from the start
            return self._find(head if tail is None else head[: max(self._end - len(tail), 0)] + tail, True)
        found = self._find(tail, False) if tail else MISSING
        if found.outcome is _REPORTED or not head:
            return found
        other = self._find(head, True)
        if other.outcome is _REPORTED or _RANK[other.outcome] > _RANK[found.outcome]:
            return other
        return found

    def _find(self, raw: bytes, at_start: bool) -> Usage:
        """The usage in one window of the body (``at_start``: it begins the body)."""
        return _framed_usage(raw, at_start) if self.chunked else _last_usage(raw, at_start)[0]


def _framed_usage(raw: bytes, at_start: bool) -> Usage:
    """The usage in bytes with their chunked framing. Framing lies between chunks, rarely within
    a usage member, and where it does the member does not parse (a size line in JSON is a value
    next to another, or a bare word): the bytes are read as they are first, and their framing is
    followed (costlier: a step per chunk) only when that met a malformed member, or when a
    usage key after the member found may be cut by framing in the last :data:`KEY_CUT_BYTES`
    (where usage is: a key cut by framing before them is not found), or chunks there are tiny."""
    found, pos, worst = _last_usage(raw, at_start)
    if worst is not UsageOutcome.MALFORMED and not _may_cut_key(raw, max(pos, len(raw) - KEY_CUT_BYTES)):
        return found
    payload = _chunks_from_start(raw) if at_start else _chunks_from_cut(raw)
    return UNREADABLE if payload is None else find_usage(payload, at_start)


def _may_cut_key(raw: bytes, start: int) -> bool:
    """Whether chunked framing in ``raw[start:]`` may cut a usage key: its chunks are tiny (a
    key may then hold several cuts), or a key's part meets a CRLF (a pattern of ``_KEY_CUT``).
    (Compiled, one pass from CR to CR: see sidecar/_usagescan.pxd.)"""
    if _COMPILED:
        return framing_may_cut_key(raw, start, len(raw))  # type: ignore[name-defined]  # noqa: F821  # cimported (usage.pxd)
    near_end = raw[start:]
    if near_end.count(b"\r\n") * 16 > len(near_end):
        return True
    if b'sage"' not in near_end and b'"us' not in near_end:
        return False
    for cut in _KEY_CUT:
        if cut in near_end:
            return True
    return False


def find_usage(payload: bytes, at_start: bool = True) -> Usage:
    """The usage in ``payload`` (a body's bytes without framing; ``at_start``: they begin the
    body, else they may begin anywhere): the last usage member that reports counts, else the
    most telling unknown outcome among those examined (at most :data:`MAX_CANDIDATES`)."""
    return _last_usage(payload, at_start)[0]


def _last_usage(payload: bytes, at_start: bool) -> tuple[Usage, int, UsageOutcome]:
    """:func:`find_usage`, where the member it reports begins (0 when none reported), and the
    most telling outcome of the members after it (or of all, when none reported)."""
    worst = MISSING
    pos = len(payload)
    for _tried in range(MAX_CANDIDATES):
        pos = _rfind_key(payload, pos)
        if pos < 0:
            break
        found = _member(payload, pos, at_start)
        if found is not None:
            if found.outcome is _REPORTED:
                return found, pos, worst.outcome
            if _RANK[found.outcome] > _RANK[worst.outcome]:
                worst = found
    return worst, 0, worst.outcome


def interpret(usage: Any) -> Usage | None:
    """The counts of one parsed usage object, by its fields (see the module docstring); None when
    it says nothing of the prompt (``{"output_tokens": 5}``)."""
    if not isinstance(usage, dict):
        return MALFORMED
    if "prompt_tokens" in usage:  # chat completions, completions
        return _with_details(usage["prompt_tokens"], usage.get("prompt_tokens_details"))
    if "input_tokens" not in usage:
        return None
    uncached = usage["input_tokens"]
    if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:  # Anthropic
        read = usage.get("cache_read_input_tokens")
        written = usage.get("cache_creation_input_tokens")
        if read is None:
            return NO_CACHED_COUNT if _count(uncached) else MALFORMED
        if written is None:
            written = 0
        if not (_count(uncached) and _count(read) and _count(written)):
            return MALFORMED
        return Usage(_REPORTED, uncached + read + written, read)
    return _with_details(uncached, usage.get("input_tokens_details"))  # Responses


def _with_details(prompt: Any, details: Any) -> Usage:
    """OpenAI's shape: a prompt count and a details object with ``cached_tokens``."""
    if not _count(prompt):
        return MALFORMED
    if details is None:
        return NO_CACHED_COUNT
    if not isinstance(details, dict):
        return MALFORMED
    cached = details.get("cached_tokens")
    if cached is None:
        return NO_CACHED_COUNT
    if not _count(cached) or cached > prompt:
        return MALFORMED
    return Usage(_REPORTED, prompt, cached)


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < MAX_COUNT


def _member(payload: bytes, pos: int, at_start: bool) -> Usage | None:
    """The usage member whose key's quote is at ``pos``: its outcome, or None when it is no
    member to count (a key inside a string, ``null``, an object cut by the window's end, one
    that says nothing of the prompt)."""
    if pos == 0 and not at_start:
        return None  # the window may begin right after a backslash: cannot tell
    slashes = 0
    j = pos - 1
    while j >= 0 and payload[j] == 0x5C:  # "\\"
        slashes += 1
        j -= 1
    if slashes % 2:
        return None  # an escaped quote: inside a string
    i = _skip_ws(payload, pos + len(_KEY))
    if i >= len(payload) or payload[i] != 0x3A:  # ":"
        return None  # a string value "usage", not a key
    i = _skip_ws(payload, i + 1)
    if i >= len(payload):
        return None
    c = payload[i]
    if c == 0x6E:  # "n": null (chunks before the last one's)
        return None
    if c != 0x7B:  # "{"
        return MALFORMED
    # The object ends at the first "}" where it parses (an object's extent is fixed by its
    # bytes: no shorter prefix of it is a JSON object, and nothing longer parses once one
    # did not at its closing brace); a usage object nests once or twice. Past a few tries (an
    # object cut by the window's end, a malformed one, braces in strings), its end is scanned.
    limit = i + _OBJECT_BYTES
    if limit > len(payload):
        limit = len(payload)
    if _COMPILED:  # read in C where it can tell (see sidecar/_usagescan.pxd), else as below
        read = scan_usage_object(payload, i, limit, _counts)  # type: ignore[name-defined]  # noqa: F821  # cimported (usage.pxd)
        if read == 1:  # SCAN_REPORTED
            return Usage(_REPORTED, _counts[0], _counts[1])  # type: ignore[name-defined]  # noqa: F821
        if read == 2:  # SCAN_SILENT
            return None
        if read == 3:  # SCAN_NO_CACHED
            return NO_CACHED_COUNT
        if read == 4:  # SCAN_MALFORMED
            return MALFORMED
    end = payload.find(b"}", i, limit)
    tries = 0
    while end >= 0 and tries < _QUICK_TRIES:
        try:
            return interpret(orjson.loads(payload[i : end + 1]))
        except orjson.JSONDecodeError:
            end = payload.find(b"}", end + 1, limit)
            tries += 1
    end = _object_end(payload, i)
    if end == -1:
        return None  # cut by the window's end
    if end == -2:
        return MALFORMED  # too long to be usage
    try:
        parsed = orjson.loads(payload[i : end + 1])
    except orjson.JSONDecodeError:
        return MALFORMED
    return interpret(parsed)


def _rfind_key(payload: bytes, end: int) -> int:
    """Where the last usage key in ``payload[:end]`` begins, -1 if none. (Compiled, memrchr to
    each ``g``: see sidecar/_usagescan.pxd.)"""
    if _COMPILED:
        return rfind_usage_key(payload, end)  # type: ignore[name-defined]  # noqa: F821  # cimported (usage.pxd)
    return payload.rfind(_KEY, 0, end)


def _skip_ws(data: bytes, i: int) -> int:
    n = len(data)
    while i < n:
        c = data[i]
        if c != 0x20 and c != 0x0A and c != 0x0D and c != 0x09:
            break
        i += 1
    return i


def _object_end(data: bytes, start: int) -> int:
    """The index of the ``}`` closing the object at ``start``: -1 when ``data`` ends first, -2
    when it would be longer than :data:`MAX_USAGE_BYTES`."""
    limit = min(len(data), start + MAX_USAGE_BYTES)
    depth = 0
    i = start
    while True:
        m = _SPECIAL.search(data, i, limit)
        if m is None:
            return -1 if limit == len(data) else -2
        i = m.start()
        c = data[i]
        if c == 0x22:  # a string: to its closing quote
            i += 1
            while True:
                s = _STRING_END.search(data, i, limit)
                if s is None:
                    return -1 if limit == len(data) else -2
                i = s.start()
                if data[i] == 0x5C:  # an escape: skip the escaped byte
                    i += 2
                    continue
                break
        elif c == 0x7B or c == 0x5B:  # "{" "["
            depth += 1
        elif c == 0x7D or c == 0x5D:  # "}" "]"
            depth -= 1
            if depth == 0:
                return i
        i += 1


def _first_event_done(head: bytes, chunked: bool) -> bool:
    """An event stream's beginning holds a whole event with a ``data`` field (``chunked``: the
    bytes have their framing, whose CRLFs may look like an event's end: followed then)."""
    at = head.find(b"data:")
    if at < 0:
        return False
    if head.find(b"\n\n", at) >= 0 or head.find(b"\r\r", at) >= 0:
        return True
    if head.find(b"\r\n\r\n", at) < 0:
        return False
    if not chunked:
        return True
    payload = _chunks_from_start(head)
    return payload is None or _first_event_done(payload, False)


def _chunks_from_start(raw: bytes) -> bytes | None:
    """The data of a chunked body's complete and partial chunks from its start; None when it is
    not chunked framing."""
    chunks: list[bytes] = []
    return b"".join(chunks) if _follow(raw, 0, chunks, [MAX_RESYNC_STEPS * 4]) else None


def _chunks_from_cut(raw: bytes) -> bytes | None:
    """The data of a chunked body's bytes cut anywhere before their end: the first chunk-size
    line (right after a CRLF) from which the framing holds to the body's last chunk, the data
    before it being the end of a chunk the window cut. Bytes that stop before the last chunk (a
    body cut short) are followed from the first line that holds to their end. None when no such
    line is found within bounds (numbers in the data look like sizes: the end decides)."""
    budget = [MAX_RESYNC_STEPS]
    for wanted in (_ENDED, _CUT):
        tries = 0
        at = 0
        while tries < MAX_RESYNC_TRIES and budget[0] > 0:
            if at < len(raw) and raw[at] in _HEX:
                tries += 1
                chunks: list[bytes] = [raw[: max(at - 2, 0)]]
                if _follow(raw, at, chunks, budget) == wanted:
                    return b"".join(chunks)
            nxt = raw.find(b"\r\n", at)
            if nxt < 0:
                break
            at = nxt + 2
    return None


# How chunked framing followed to the end of the bytes ends: not framing, cut, ended.
_NOT_FRAMING, _CUT, _ENDED = 0, 1, 2


def _follow(raw: bytes, at: int, chunks: list[bytes], budget: list[int]) -> int:
    """Follow chunked framing from ``raw[at]`` (a size line) to the end of ``raw``, appending
    each chunk's data (a last partial one included) to ``chunks``: :data:`_ENDED` at the last
    chunk (and its trailers), :data:`_CUT` when the bytes end before it, :data:`_NOT_FRAMING`
    when they are not framing or ``budget`` (steps left, shared by the tries) runs out."""
    n = len(raw)
    match = _SIZE_LINE.match
    while at < n:
        budget[0] -= 1
        if budget[0] < 0:
            return _NOT_FRAMING
        m = match(raw, at)
        if m is None:  # not a size line, or one cut at the end
            cut = n - at < 1024 and _SIZE_LINE_CUT.fullmatch(raw, at) is not None
            return _CUT if cut else _NOT_FRAMING
        size = int(m.group(1), 16)
        start = m.end()
        if size == 0:  # the last chunk: then trailer fields, and the empty line ending the bytes
            return _trailers(raw[start:])
        if start + size >= n:
            chunks.append(raw[start:])  # a chunk cut at the end
            return _CUT
        chunks.append(raw[start : start + size])
        at = start + size
        if raw[at : at + 2] != b"\r\n"[: n - at]:
            return _NOT_FRAMING
        at += 2
    return _CUT


def _trailers(rest: bytes) -> int:
    """What follows a last chunk's size line: trailer fields (``name: value`` lines), then an
    empty line (:data:`_ENDED`), or cut before it (:data:`_CUT`)."""
    if len(rest) > 8192:
        return _NOT_FRAMING
    lines = rest.split(b"\r\n")
    if len(lines) > 1 and lines[-1] == b"" and lines[-2] == b"":
        fields, outcome = lines[:-2], _ENDED
    else:
        fields, outcome = lines[:-1], _CUT  # its last line may be partial
    return outcome if all(_FIELD.match(line) is not None for line in fields) else _NOT_FRAMING
