"""Prompt-cache accounting: what the responses' usage (:mod:`sidecar.usage`) says, counted per
deployment, mode and turn bucket for Prometheus, and kept for the live view's charts.

Turns are bucketed 1, 2, 3-5, 6-10, 11+ (:data:`TURN_BUCKETS`): a session's first turn has
nothing of its own to reuse, later ones should find their conversation's prefix cached on the
worker that served it. The cached ratio of a bucket is its cached prompt tokens over its prompt
tokens, both counted only for responses that reported both.

The live view's aggregates cover the last :data:`WINDOW_SECONDS`, in slots of
:data:`SLOT_SECONDS`: a fixed ring of per-bucket sums, so memory is constant whatever the
traffic, and counting a response is a few integer additions. They are this replica's responses
(the per-session and per-tree totals are the store's, fleet-wide).

Opt-in per deployment (``usage.include_usage``), :func:`with_include_usage` asks a streamed chat
completion for its usage, which OpenAI-compatible servers send only when asked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sidecar.config import Config
from sidecar.jsonbody import RepeatedKeys, load_bounded, scan_body, splice
from sidecar.metrics import Metrics
from sidecar.usage import Usage, UsageOutcome

__all__ = ["SLOT_SECONDS", "TURN_BUCKETS", "WINDOW_SECONDS", "Accounting", "turn_bucket", "with_include_usage"]

TURN_BUCKETS = ("1", "2", "3-5", "6-10", "11+")
WINDOW_SECONDS = 900
SLOT_SECONDS = 30
_SLOTS = WINDOW_SECONDS // SLOT_SECONDS
_SLOT_SECONDS = float(SLOT_SECONDS)
_B = len(TURN_BUCKETS)
# A slot's layout: [slot number, prompt tokens by bucket..., cached tokens by bucket..., responses
# that reported by bucket..., responses without usable usage]
_PROMPT, _CACHED, _REPORTING, _UNKNOWN = 1, 1 + _B, 1 + 2 * _B, 1 + 3 * _B
_REPORTED = UsageOutcome.REPORTED


def turn_bucket(turn: int) -> int:
    """The index in :data:`TURN_BUCKETS` of a session's 1-based ``turn``."""
    if turn <= 2:
        return 0 if turn <= 1 else 1
    if turn <= 5:
        return 2
    return 3 if turn <= 10 else 4


class Accounting:
    """The prompt-cache counters of every deployment and the live view's aggregates. Synchronous,
    on the event loop, like the router that owns it."""

    def __init__(self, config: Config, metrics: Metrics, clock: Callable[[], float] = time.time) -> None:
        settings = [(d.name, d.usage) for d in config.resolved_deployments()]
        # The deployments that account and that inject, as sets: asked per response (a pydantic
        # model's attribute read costs hundreds of instructions).
        self._accounted = frozenset(name for name, usage in settings if usage.accounting)
        self._injected = frozenset(name for name, usage in settings if usage.include_usage)
        self._metrics = metrics
        self._clock = clock
        # (deployment, mode, bucket) -> (prompt counter, cached counter); (deployment, mode,
        # outcome) -> responses counter: children looked up once (closed label sets)
        self._tokens: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        self._responses: dict[tuple[str, str, UsageOutcome], Any] = {}
        self._slots: list[list[int]] = [[-1] + [0] * (3 * _B + 1) for _ in range(_SLOTS)]

    def accounts(self, deployment: str) -> bool:
        """Whether ``deployment`` reads its responses' usage (``usage.accounting``)."""
        return deployment in self._accounted

    def injects(self, deployment: str) -> bool:
        """Whether ``deployment`` asks for usage in streamed chat completions (``usage.include_usage``)."""
        return deployment in self._injected

    def count(self, deployment: str, mode: str, turn: int, usage: Usage) -> None:
        """One response of a session's ``turn`` and what it said of its usage."""
        key = (deployment, mode, usage.outcome)
        responses = self._responses.get(key)
        if responses is None:
            responses = self._responses[key] = self._metrics.usage_responses.labels(*key)
        responses.inc()
        slot = self._slot()
        if usage.outcome is not _REPORTED:
            slot[_UNKNOWN] += 1
            return
        bucket = turn_bucket(turn)
        tokens = self._tokens.get((deployment, mode, bucket))
        if tokens is None:
            label = TURN_BUCKETS[bucket]
            tokens = self._tokens[(deployment, mode, bucket)] = (
                self._metrics.prompt_tokens.labels(deployment, mode, label),
                self._metrics.cached_prompt_tokens.labels(deployment, mode, label),
            )
        tokens[0].inc(usage.prompt_tokens)
        tokens[1].inc(usage.cached_tokens)
        slot[_PROMPT + bucket] += usage.prompt_tokens
        slot[_CACHED + bucket] += usage.cached_tokens
        slot[_REPORTING + bucket] += 1

    def _slot(self) -> list[int]:
        now = self._clock()
        number = int(now // _SLOT_SECONDS)
        slot = self._slots[number % _SLOTS]
        if slot[0] != number:  # a slot of an older round: cleared for this one
            slot[:] = [number] + [0] * (3 * _B + 1)
        return slot

    def snapshot(self) -> dict[str, Any]:
        """The live view's aggregates over the last :data:`WINDOW_SECONDS`: per turn bucket
        (``by_turn``), and per slot, oldest first (``series``; slots without responses left
        out). Times are unix seconds; ``cached_ratio`` is None where nothing reported."""
        now = int(self._clock() // SLOT_SECONDS)
        live = sorted((s for s in self._slots if now - _SLOTS < s[0] <= now), key=lambda s: s[0])
        totals = [0] * (3 * _B + 1)
        series = []
        for slot in live:
            for i in range(len(totals)):
                totals[i] += slot[1 + i]
            series.append(
                {
                    "at": slot[0] * SLOT_SECONDS,
                    "prompt_tokens": slot[_PROMPT : _PROMPT + _B],
                    "cached_tokens": slot[_CACHED : _CACHED + _B],
                    "reported_responses": slot[_REPORTING : _REPORTING + _B],
                    "unknown_responses": slot[_UNKNOWN],
                }
            )
        return {
            "window_seconds": WINDOW_SECONDS,
            "slot_seconds": SLOT_SECONDS,
            "turn_buckets": list(TURN_BUCKETS),
            "by_turn": [
                _bucket(TURN_BUCKETS[b], totals[_PROMPT - 1 + b], totals[_CACHED - 1 + b], totals[_REPORTING - 1 + b])
                for b in range(_B)
            ],
            "unknown_responses": totals[_UNKNOWN - 1],
            "series": series,
        }


def _bucket(turn: str, prompt: int, cached: int, reported: int) -> dict[str, Any]:
    return {
        "turn": turn,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_ratio": cached / prompt if prompt else None,
        "reported_responses": reported,
    }


# The top-level members a streamed chat completion request's usage patch reads.
_STREAM_NAMES = (b"stream", b"stream_options")


def with_include_usage(body: bytes, max_depth: int) -> bytes | None:
    """``body`` (a chat completions request) asking for usage in its stream: a JSON object whose
    ``stream`` is ``true`` gets ``stream_options.include_usage: true`` spliced in (its other
    ``stream_options`` members, and every other byte, kept: :class:`~sidecar.context.BodyPatch`'s
    rules). None when nothing changes: not a JSON object nested at most ``max_depth`` deep, not
    streamed, or asking already."""
    scanned = scan_body(body, max_depth, _STREAM_NAMES)
    if not scanned.is_object:
        return None
    stream = scanned.member(b"stream")
    if stream is None or body[stream[0] : stream[1]] != b"true":
        return None
    options = scanned.member(b"stream_options")
    if options is not None:
        current = load_bounded(body, options[0], options[1], 4096)
        if isinstance(current, dict) and current.get("include_usage") is True:
            return None
    try:
        return splice(scanned, ("stream_options",), {"include_usage": True})
    except (RepeatedKeys, TypeError):
        return None
