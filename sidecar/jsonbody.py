"""JSON request bodies kept as the client's bytes: read a few members, splice a patch in.

:func:`scan_body` validates a body (:mod:`sidecar.jsonscan`: strict, bounded depth, no Python
objects built) and locates the top-level members the caller names. The readers decode only
those members' values (:meth:`ScannedBody.string`, :func:`members`, :func:`load_bounded`), so
what a routing decision reads costs what the decision needs, not what the body holds.

:func:`splice` makes a JSON object contain given values at a path by editing the original
bytes: numbers, key order, duplicate keys, whitespace and string escapes outside the edited
members reach the upstream exactly as the client sent them (its rules are on the function).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from sidecar import jsonscan
from sidecar.jsonscan import INVALID, TOO_DEEP, TOO_MANY, assemble, members_json, scan

__all__ = [
    "INVALID",
    "TOO_DEEP",
    "TOO_MANY",
    "RepeatedKeys",
    "ScannedBody",
    "load_bounded",
    "members",
    "scan_body",
    "splice",
]

_OBJECT = 0x7B  # {
_QUOTE = 0x22  # "
_WS = re.compile(rb"[ \t\n\r]*")
_SEPARATOR = re.compile(rb"[ \t\n\r]*,[ \t\n\r]*")
# Nested objects are scanned (already validated) up to the scanner's own bound.
_ANY_DEPTH = jsonscan.MAX_DEPTH


class RepeatedKeys(ValueError):
    """An object repeats the keys to locate more often than a scan reports
    (:data:`sidecar.jsonscan.MAX_HITS`): the client's body is at fault, not the caller."""


class ScannedBody:
    """A request body after :func:`scan_body`. ``status`` is the document's depth when it is
    valid JSON, else :data:`INVALID`, :data:`TOO_DEEP` or :data:`TOO_MANY`."""

    __slots__ = ("data", "status", "start", "end", "last", "names", "hits")

    def __init__(
        self, data: bytes, status: int, start: int, end: int, last: int, names: tuple[bytes, ...], hits: list[int]
    ) -> None:
        self.data = data
        self.status = status
        self.start = start  # the top-level value's span
        self.end = end
        self.last = last  # where its last member ends (see jsonscan.scan)
        self.names = names  # the top-level keys located
        self.hits = hits

    @property
    def is_object(self) -> bool:
        return self.status >= 0 and self.data[self.start] == _OBJECT

    def member(self, name: bytes) -> tuple[int, int] | None:
        """The value span of the last top-level member named ``name`` (one of ``names``; a
        repeated key reads as its last occurrence, as in orjson and json), or None."""
        index = self.names.index(name)
        hits = self.hits
        for i in range(len(hits) - 5, -1, -5):
            if hits[i] == index:
                return hits[i + 3], hits[i + 4]
        return None

    def string(self, name: bytes, max_bytes: int) -> str | None:
        """The last top-level member ``name`` when it is a JSON string of at most ``max_bytes``
        (encoded), decoded; else None."""
        span = self.member(name)
        if span is None:
            return None
        return string_at(self.data, span[0], span[1], max_bytes)


def scan_body(data: bytes, max_depth: int, names: tuple[bytes, ...]) -> ScannedBody:
    """Validate ``data`` as one JSON document nested at most ``max_depth`` deep and locate its
    top-level members named in ``names`` (bytes; at most :data:`~sidecar.jsonscan.MAX_NAMES`)."""
    status, start, end, last, hits = scan(data, 0, len(data), max_depth, names)
    return ScannedBody(data, status, start, end, last, names, hits)


def string_at(data: bytes, start: int, end: int, max_bytes: int) -> str | None:
    """The JSON string at ``data[start:end]`` decoded, or None: not a string, longer than
    ``max_bytes``, or an escape orjson refuses (an unpaired surrogate)."""
    if data[start] != _QUOTE or end - start > max_bytes + 2:
        return None
    try:
        value = orjson.loads(data[start:end])
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def members(data: bytes, start: int, end: int, names: tuple[bytes, ...]) -> list[tuple[int, int, int, int, int]]:
    """``(name index, key start, key end, value start, value end)`` of each member named in
    ``names`` of the object at ``data[start:end]`` (a span of a scanned body), in document order.
    Raises :class:`RepeatedKeys` past :data:`~sidecar.jsonscan.MAX_HITS` of them."""
    status, _, _, _, hits = scan(data, start, end, _ANY_DEPTH, names)
    if status == TOO_MANY:
        raise RepeatedKeys(
            f"an object repeats the keys {[n.decode() for n in names]} more than {jsonscan.MAX_HITS} times"
        )
    return [(hits[i], hits[i + 1], hits[i + 2], hits[i + 3], hits[i + 4]) for i in range(0, len(hits), 5)]


def load_bounded(data: bytes, start: int, end: int, max_bytes: int) -> Any:
    """The value at ``data[start:end]`` (a span of a scanned body) as Python objects when it is
    at most ``max_bytes`` long; a larger one as an ``orjson.Fragment`` of its bytes, which
    serializes back to them unchanged (so a caller hashing values never parses an unbounded
    amount of client JSON into objects)."""
    raw = data[start:end]
    if end - start > max_bytes:
        return orjson.Fragment(raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:  # valid JSON that orjson refuses (1e400, a lone surrogate)
        return orjson.Fragment(raw)


def splice(body: ScannedBody, path: tuple[str, ...], values: dict[str, Any], owned: tuple[str, ...] = ()) -> bytes:
    """``body`` (a JSON object) with the object at ``path`` made to contain ``values``.

    - ``path`` names keys from the top level down; a missing object on it is created, a value on
      it that is not an object is replaced by one;
    - a key repeated on the path: its last occurrence is the one followed (the one parsers
      keep), the earlier ones are removed, so the upstream sees the key once;
    - in the object at ``path``, the client's members named in ``owned`` or in ``values`` are
      removed (every occurrence), then ``values`` are appended after the remaining members,
      serialized compactly;
    - every other byte stays as the client sent it.

    Raises :class:`RepeatedKeys` (the body repeats one of those keys more often than the scanner
    reports) and ``TypeError`` (a key that is not a string, a value orjson cannot serialize, more
    keys to remove than a scan looks for).
    """
    paths = _PATHS.get(path)
    if paths is None:
        paths = _path_bytes(path)
    keys: tuple[bytes, ...] = paths[0]
    opens: tuple[bytes, ...] = paths[1]
    insert = members_json(values)  # the members to append
    data = body.data
    start, last = body.start, body.last
    if keys[0] in body.names:
        hits = body.hits
        index = body.names.index(keys[0])
        found = [(hits[i + 1], hits[i + 3], hits[i + 4]) for i in range(0, len(hits), 5) if hits[i] == index]
    else:  # a second pass over the top level (the router has its usual keys located by the first)
        last, found = _located(data, start, body.end, (keys[0],))
    edits: list[tuple[int, int, bytes]] = []
    depth = 0
    while True:
        if not found:  # create the rest of the path here: "key":{...{<insert>}...}
            member = b"".join((opens[depth], insert, b"}" * (len(path) - depth)))
            edits.append((last, last, member if last == start + 1 else b"," + member))
            break
        if len(found) > 1:
            _edit_object(data, start, last, [(ks, ve) for ks, _, ve in found[:-1]], b"", edits)
        _, start, end = found[-1]
        depth += 1
        if data[start] != _OBJECT:  # replaced by an object: {...{<insert>}...}
            edits.append((start, end, b"".join((b"{", opens[depth], insert, b"}" * (len(path) - depth + 1)))))
            break
        if depth < len(path):
            last, found = _located(data, start, end, (keys[depth],))
            continue
        # The object at path: every member the patch owns goes, the values follow the rest.
        last, found = _located(data, start, end, _owned_names(owned, values))
        _edit_object(data, start, last, [(ks, ve) for ks, _, ve in found], insert, edits)
        break
    edits.sort()
    return assemble(data, edits)


def _located(data: bytes, start: int, end: int, names: tuple[bytes, ...]) -> tuple[int, list[tuple[int, int, int]]]:
    """Where the last member of the object at ``data[start:end]`` ends, and the key start, value
    start and value end of its members named in ``names``."""
    if len(names) > jsonscan.MAX_NAMES:
        raise TypeError(f"a body patch removes at most {jsonscan.MAX_NAMES} keys")
    status, _, _, last, hits = scan(data, start, end, _ANY_DEPTH, names)
    if status == TOO_MANY:
        raise RepeatedKeys(
            f"an object repeats the keys {[n.decode() for n in names]} more than {jsonscan.MAX_HITS} times"
        )
    assert status >= 0, "a span of a scanned body is valid JSON"
    return last, [(hits[i + 1], hits[i + 3], hits[i + 4]) for i in range(0, len(hits), 5)]


def _owned_names(owned: tuple[str, ...], values: dict[str, Any]) -> tuple[bytes, ...]:
    """The keys a patch removes from the object at its path, as bytes, each once."""
    try:
        return tuple(dict.fromkeys([*(k.encode() for k in owned), *(k.encode() for k in values)]))
    except AttributeError:
        raise TypeError("a body patch's owned names are strings") from None


def _path_bytes(path: tuple[str, ...]) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """A patch path's keys as bytes, and for each depth the opening of the objects from there
    down: ``'"b":{"c":{'`` for depth 1 of ``("a", "b", "c")``. Cached in ``_PATHS`` (modes use a
    path or two), which :func:`splice` reads first."""
    if not path or not all(type(k) is str for k in path):
        raise TypeError(f"a body patch's path is a non-empty tuple of string keys (got {path!r:.100})")
    opens = [b""]
    for key in reversed(path):
        opens.append(orjson.dumps(key) + b":{" + opens[-1])
    result = tuple(k.encode() for k in path), tuple(reversed(opens))
    if len(_PATHS) < 256:
        _PATHS[path] = result
    return result


_PATHS: dict[tuple[str, ...], tuple[tuple[bytes, ...], tuple[bytes, ...]]] = {}


def _edit_object(
    data: bytes,
    start: int,
    last: int,
    removed: list[tuple[int, int]],
    insert: bytes,
    edits: list[tuple[int, int, bytes]],
) -> None:
    """Add to ``edits`` what removes the members ``removed`` (key start, value end; document
    order) from the object that starts at ``data[start]`` and appends the member bytes
    ``insert`` (b"": none), keeping every separator and whitespace of the members left.
    ``last`` is where the object's last member ends (``start + 1`` when it is empty)."""
    emptied = False
    i = 0
    while i < len(removed):
        first, run_end = removed[i]
        i += 1
        # A run of adjacent members goes as one: with the comma before it, or after it when it
        # opens the object.
        while i < len(removed) and _SEPARATOR.fullmatch(data, run_end, removed[i][0]):
            run_end = removed[i][1]
            i += 1
        comma = data.rfind(b",", start, first)  # only whitespace lies between the separator and a key
        if comma >= 0:
            edits.append((comma, run_end, b""))
            continue
        after = _WS.match(data, run_end).end()  # type: ignore[union-attr]
        if data[after] == 0x2C:  # ,
            edits.append((first, after + 1, b""))
        else:  # the run is every member
            edits.append((first, run_end, insert))
            emptied = True
    if insert and not emptied:
        if last == start + 1:  # an empty object
            edits.append((last, last, insert))
        else:
            edits.append((last, last, b"," + insert))
