"""A session as the shared store keeps it: one small hash per id (short field names, because every
live session costs its bytes in Redis), read into :class:`Record`.

Fields: ``d`` deployment, ``p`` parent (the root hint for a hinted session), ``r`` root (absent:
the id itself), ``f`` flags (:class:`sidecar.lineage.SessionFlag`), ``c`` created and ``a`` last active
(unix ms), ``n`` turns, ``e`` end reason and ``z`` when it started closing or ended (ms), ``m``
the mode's state, ``w``/``wt``/``mv`` the worker history, ``pt``/``ct``/``ut``/``uu`` the
prompt-cache accounting (prompt and cached tokens, turns with usage, turns without; each only
once non-zero), and for API sessions ``ws`` workspace,
``t`` TTL seconds and ``q`` creation sequence. ``h:<replica>`` are holders (requests in flight),
``o`` the replica that claimed the session's end and has not confirmed it yet.

A record comes from a server anyone with access can write to, or from a newer version: it is
untrusted input. One that does not decode raises :class:`BadRecord` naming its field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from sidecar.context import SessionFlag

PLACEHOLDER, FINAL_SEEN, CLOSED, ENDED, HINTED, API = (
    SessionFlag.PLACEHOLDER,
    SessionFlag.FINAL_SEEN,
    SessionFlag.CLOSED,
    SessionFlag.ENDED,
    SessionFlag.HINTED,
    SessionFlag.API,
)


# The prompt-cache accounting's fields, in Record.usage's order (incremented by the flush's A op).
_USAGE_FIELDS = ("pt", "ct", "ut", "uu")


@dataclass(slots=True)
class Record:
    """One session record, decoded. Times are unix seconds."""

    id: str
    deployment: str
    flags: int
    parent: str | None  # the declared parent (None for roots and hinted sessions)
    above: str | None  # the node it hangs under: the parent, or the root hint of a hinted session
    root: str
    created: float
    last_active: float
    turns: int
    end_reason: str | None
    ended_at: float | None
    mode_state: str | None
    workers: list[Any] | None
    worker_turns: int
    moves: int
    # prompt-cache accounting: prompt and cached tokens, turns with usage, turns without
    usage: tuple[int, int, int, int]
    workspace: str | None
    ttl: float | None
    seq: int
    in_flight: int  # summed over the replicas' holder fields

    @property
    def placeholder(self) -> bool:
        return bool(self.flags & PLACEHOLDER)

    @property
    def ended(self) -> bool:
        return bool(self.flags & ENDED)

    @property
    def closing(self) -> bool:
        return bool(self.flags & CLOSED) and not self.flags & ENDED

    @property
    def live(self) -> bool:
        """A session that began and has not started to close or end."""
        return not self.flags & (PLACEHOLDER | CLOSED | ENDED)

    @property
    def final_seen(self) -> bool:
        return bool(self.flags & FINAL_SEEN)

    @property
    def api(self) -> bool:
        return bool(self.flags & API)


class BadRecord(ValueError):
    """A stored record that does not decode."""

    def __init__(self, session: str, field: str) -> None:
        super().__init__(f"the stored record of session {session!r} cannot be read (field {field!r})")
        self.session = session
        self.field = field


def decode(session: str, fields: dict[str, str]) -> Record | None:
    """The record of ``session`` from its hash fields (as HGETALL returns them), None when empty.
    Raises :class:`BadRecord` when a field does not decode."""
    if not fields:
        return None
    field = "f"
    try:
        flags = int(fields.get("f", "0"))
        if flags < 0:
            raise ValueError(flags)
        above = fields.get("p") or None
        in_flight = sum(int(v) for k, v in fields.items() if k.startswith("h:") and v.lstrip("-").isdigit())
        field, workers = "w", fields.get("w")
        workers_list = orjson.loads(workers) if workers else None
        if workers_list is not None and not isinstance(workers_list, list):
            raise ValueError(workers)
        field, ttl = "t", fields.get("t")
        ttl_seconds = float(ttl) if ttl else None
        if ttl_seconds is not None and not math.isfinite(ttl_seconds):
            raise ValueError(ttl)
        field, ended_at = "z", fields.get("z")
        ended = int(ended_at) / 1000 if ended_at else None
        field, created = "c", int(fields.get("c", "0")) / 1000
        field, last_active = "a", int(fields.get("a", "0")) / 1000
        field, turns = "n", int(fields.get("n", "0"))
        field, worker_turns = "wt", int(fields.get("wt", "0"))
        field, moves = "mv", int(fields.get("mv", "0"))
        field, seq = "q", int(fields.get("q", "0"))
        usage = []
        for field in _USAGE_FIELDS:
            count = int(fields.get(field, "0"))
            if count < 0:
                raise ValueError(count)
            usage.append(count)
    except (ValueError, TypeError, orjson.JSONDecodeError):
        raise BadRecord(session, field) from None
    return Record(
        id=session,
        deployment=fields.get("d", ""),
        flags=flags,
        parent=None if flags & HINTED else above,
        above=above,
        root=fields.get("r") or session,
        created=created,
        last_active=last_active,
        turns=turns,
        end_reason=fields.get("e") or None,
        ended_at=ended,
        mode_state=fields.get("m") or None,
        workers=workers_list,
        worker_turns=worker_turns,
        moves=moves,
        usage=(usage[0], usage[1], usage[2], usage[3]),
        workspace=fields.get("ws") or None,
        ttl=ttl_seconds,
        seq=seq,
        in_flight=in_flight,
    )


def ms(seconds: float) -> int:
    """Unix seconds as the store's integer milliseconds."""
    return int(seconds * 1000)
