"""Which session, parent, root and final-turn flag a request declares.

Header signals come in families (``identity.clients``), tried in the configured order; the
first family whose session signal a request carries (with a non-empty value) gives the
request's session, parent and root, all from that family:

- ``generic``: ordered header lists (``identity.session``, ``parent``, ``root``): AIPerf,
  opencode, any client that names its session, parent and root in headers of its own;
- ``claude_code``: ``x-claude-code-session-id`` names the conversation on every request; a
  sub-agent's requests add its own ``x-claude-code-agent-id``, which is not unique beyond the
  conversation, so its session is ``<conversation>.<agent>`` (:func:`agent_session`); its parent
  is the agent named by ``x-claude-code-parent-agent-id`` (same form), else the conversation;
  its root is the conversation;
- ``codex``: ``thread-id`` is the agent's own thread (the session), ``x-codex-parent-thread-id``
  a sub-agent's parent, ``session-id`` the main thread (the root, never the session).

The final-turn flag (``identity.final``) is read whatever the family. Header signals never
touch the body. When configured, body signals name the session of a
request whose headers name none (the router then scans the body once, locating the top-level
members in :attr:`IdentityReader.body_keys`; see :meth:`IdentityReader.read_body`). Only the
values a signal needs are decoded, each within a bound:

- ``prompt_cache_key``, ``user``: OpenAI-compatible chat / responses body fields.
- ``metadata.user_id``: Anthropic-style ``/v1/messages`` bodies (Claude Code), whose
  ``metadata.user_id`` is a JSON object string carrying ``session_id`` (older clients: a string
  ending in ``_session_<id>``).
- ``conversation``: OpenAI Responses API bodies naming their conversation (a string, or an
  object's ``id``).
- ``previous_response_id``: OpenAI Responses API bodies (those with ``input``) that chain on a
  previous response: the identity names no session but the response it continues
  (:attr:`Identity.response`, ``""`` for a Responses request that names none); the router looks
  the session that produced it up (:mod:`sidecar.state`), and starts a new one when there is
  none.
- ``fingerprint``: a stable hash of the system prompt and the first user message, identical on
  every turn of one conversation (each turn resends the whole history) and different across
  conversations that start differently. It reads at most :data:`FINGERPRINT_MAX_MESSAGES`
  messages (a user message later than that gives no fingerprint); each part hashed is
  canonicalized (parsed, keys sorted) when at most :data:`FINGERPRINT_PARSE_BYTES` long, and
  hashed as sent when longer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from sidecar import headers as h
from sidecar.config import IdentityConfig
from sidecar.headers import is_field_value, lookup
from sidecar.jsonbody import RepeatedKeys, ScannedBody, load_bounded, members, string_at
from sidecar.jsonscan import elements
from sidecar.modes.ids import fit_id, opaque_id

# A body value longer than this is no session id (header values are bounded alike).
MAX_ID_BYTES = 64 * 1024
# What the fingerprint reads: messages before the first user message, and the size up to which
# a part is parsed to canonicalize it (larger parts are hashed as sent: parsing a client's JSON
# into objects costs memory many times its size).
FINGERPRINT_MAX_MESSAGES = 64
FINGERPRINT_PARSE_BYTES = 64 * 1024

_TRUE = frozenset({"true", "1", "yes", "on"})

# The client families (identity.clients), as the small integers the reader dispatches on.
_GENERIC, _CLAUDE_CODE, _CODEX = 0, 1, 2
_FAMILIES = {"generic": _GENERIC, "claude_code": _CLAUDE_CODE, "codex": _CODEX}
_CLAUDE_SESSION = h.X_CLAUDE_CODE_SESSION_ID.lower()
_CLAUDE_AGENT = h.X_CLAUDE_CODE_AGENT_ID.lower()
_CLAUDE_PARENT_AGENT = h.X_CLAUDE_CODE_PARENT_AGENT_ID.lower()
_CODEX_THREAD = h.CODEX_THREAD_ID.lower()
_CODEX_ROOT = h.CODEX_SESSION_ID.lower()
_CODEX_PARENT = h.X_CODEX_PARENT_THREAD_ID.lower()
# Between a Claude Code conversation and one of its agents in the agent's session id: a
# character that no conversation (a UUID) or agent id holds, that is safe in a URL path (the
# sessions API names sessions in paths) and in every gateway's id (`[A-Za-z0-9._-]`).
AGENT_SEPARATOR = "."


def agent_session(conversation: str, agent: str) -> str:
    """The session id of Claude Code agent ``agent`` of ``conversation``: agent ids are short and
    random, unique within a conversation only."""
    return conversation + AGENT_SEPARATOR + agent


# Not frozen: a frozen dataclass costs more per construction (once per request with a session).
# Treat it as read-only (NO_SESSION is shared by every request without one). No slots=True:
# compiled (identity.pxd), it is an extension type with fixed fields.
@dataclass
class Identity:
    """A request's declared identity; ``session is None`` means "not part of a session"."""

    session: str | None
    parent: str | None = None
    root: str | None = None
    final: bool = False
    # Body signal previous_response_id: the response this request continues ("" for a Responses
    # request that continues none); the router resolves it to a session. None otherwise.
    response: str | None = None


NO_SESSION = Identity(session=None)


def _identity(session: str, parent: str | None, root: str | None, final: bool) -> Identity:
    """``Identity(...)`` built field by field: compiled, an allocation and stores (calling the
    class packs its arguments into a tuple and parses them; once per request of a session)."""
    ident = Identity.__new__(Identity)
    ident.session = session
    ident.parent = parent
    ident.root = root
    ident.final = final
    ident.response = None
    return ident


class IdentityReader:
    """Reads :class:`Identity` from a request's headers, by the configured ordered signals."""

    __slots__ = (
        "_families",
        "_session",
        "_parent",
        "_root",
        "_final",
        "_lineage",
        "_body",
        "_fingerprint",
        "header_names",
        "reads_body",
        "body_keys",
        "_max_id_bytes",
        "_fits",
    )

    def __init__(self, cfg: IdentityConfig, max_id_bytes: int = 512) -> None:
        # Ids longer than this many UTF-8 bytes are fitted (sidecar.modes.ids): up to _fits
        # characters every id fits, and the common id costs one length check.
        self._max_id_bytes = max_id_bytes
        self._fits = max_id_bytes // 4
        self._body = tuple(cfg.body)
        self._fingerprint = cfg.fingerprint
        # Whether a request whose headers name no session must have its body scanned, and the
        # top-level keys the scan must locate for read_body.
        self.reads_body = cfg.reads_body
        keys = [key for signal in cfg.body for key in _BODY_KEYS[signal]]
        keys += [b"system", b"messages"] if cfg.fingerprint else []
        self.body_keys = tuple(dict.fromkeys(keys))
        self._families = tuple(_FAMILIES[c] for c in cfg.clients)
        generic = "generic" in cfg.clients
        self._session = tuple(n.lower() for n in cfg.session) if generic else ()
        self._parent = tuple(n.lower() for n in cfg.parent) if generic else ()
        self._root = tuple(n.lower() for n in cfg.root) if generic else ()
        self._final = tuple(n.lower() for n in cfg.final)
        # Every lineage signal (parent, root, final), for the one scan that usually finds none.
        self._lineage = self._parent + self._root + self._final
        # Every header the reader consumes (lower-case), for engines that index only these.
        names = self._session + self._parent + self._root + self._final
        if "claude_code" in cfg.clients:
            names += (_CLAUDE_SESSION, _CLAUDE_AGENT, _CLAUDE_PARENT_AGENT)
        if "codex" in cfg.clients:
            names += (_CODEX_THREAD, _CODEX_ROOT, _CODEX_PARENT)
        self.header_names = frozenset(names)

    def _first(self, headers: Mapping[str, str], names: tuple[str, ...]) -> str | None:
        for name in names:
            value = lookup(headers, name)
            if value:
                value = value.strip()
                if value:
                    return self._bounded(value)
        return None

    def _bounded(self, value: str) -> str:
        """``value`` as the sidecar keeps and forwards it: ids over the byte cap fitted, ids that
        cannot travel in a header (control characters, from a body signal) made opaque."""
        if len(value) > self._fits:
            value = fit_id(value, self._max_id_bytes)
        if not is_field_value(value):
            value = opaque_id(value)
        return value

    def read(self, headers: Mapping[str, str]) -> Identity:
        """``headers`` maps lower-case names to values (first occurrence)."""
        # Flattened: this runs once per request (the common miss costs one lookup per session
        # signal of each family).
        for family in self._families:
            if family == _GENERIC:
                for name in self._session:
                    value = lookup(headers, name)
                    if value:
                        value = value.strip()
                        if value:
                            return self._with_session(headers, value)
            elif family == _CLAUDE_CODE:
                value = lookup(headers, _CLAUDE_SESSION)
                if value:
                    value = value.strip()
                    if value:
                        return self._claude_code(headers, value)
            else:
                value = lookup(headers, _CODEX_THREAD)
                if value:
                    value = value.strip()
                    if value:
                        return self._codex(headers, value)
        return NO_SESSION

    def _claude_code(self, headers: Mapping[str, str], conversation: str) -> Identity:
        """A Claude Code request of ``conversation``: the conversation's own, or one of its
        agents' (a child of its parent agent, else of the conversation)."""
        final = self._final_flag(headers)
        agent = self._value(headers, _CLAUDE_AGENT)
        if agent is None or agent == conversation:
            return _identity(self._bounded(conversation), None, None, final)
        parent_agent = self._value(headers, _CLAUDE_PARENT_AGENT)
        if parent_agent is not None and parent_agent != agent:
            parent = self._bounded(agent_session(conversation, parent_agent))
        else:
            parent = self._bounded(conversation)
        session = self._bounded(agent_session(conversation, agent))
        return _identity(session, parent, self._bounded(conversation), final)

    def _codex(self, headers: Mapping[str, str], thread: str) -> Identity:
        """A Codex request of agent thread ``thread``: its parent thread, and the main thread as
        the root."""
        parent = self._value(headers, _CODEX_PARENT)
        root = self._value(headers, _CODEX_ROOT)
        return _identity(
            self._bounded(thread),
            None if parent is None or parent == thread else self._bounded(parent),
            None if root is None or root == thread else self._bounded(root),
            self._final_flag(headers),
        )

    def _value(self, headers: Mapping[str, str], name: str) -> str | None:
        """The stripped value of header ``name``; None when absent or blank."""
        value = lookup(headers, name)
        if value:
            value = value.strip()
            if value:
                return value
        return None

    def _final_flag(self, headers: Mapping[str, str]) -> bool:
        final = self._first(headers, self._final) if self._final else None
        return final is not None and final.lower() in _TRUE

    def read_body(self, headers: Mapping[str, str], body: ScannedBody) -> Identity:
        """The identity of a request whose headers named no session, from its ``body`` (scanned
        with :attr:`body_keys` located) by the configured body signals (parent, root and final
        still come from headers). Pure: safe on a worker thread."""
        if not body.is_object:
            return NO_SESSION
        for signal in self._body:
            if signal == "previous_response_id":
                previous = previous_response(body)
                if previous is not None:
                    return self._chained(headers, previous)
                continue
            session = _BODY_READERS[signal](body)
            if session:
                return self._with_session(headers, session)
        if self._fingerprint:
            session = conversation_fingerprint(body)
            if session:
                return self._with_session(headers, session)
        return NO_SESSION

    def _chained(self, headers: Mapping[str, str], previous: str) -> Identity:
        """A Responses request continuing response ``previous`` ("": none), its lineage from
        the headers; the router names its session."""
        first = self._first
        parent = first(headers, self._parent) if self._parent else None
        root = first(headers, self._root) if self._root else None
        return Identity(None, parent, root, self._final_flag(headers), self._bounded(previous) if previous else "")

    def _with_session(self, headers: Mapping[str, str], session: str) -> Identity:
        # Flattened: most requests carry no lineage header, and one scan settles that without a
        # call per signal (Identity is built positionally: cheaper than by keyword).
        session = self._bounded(session)
        for name in self._lineage:
            if lookup(headers, name):
                break
        else:
            return _identity(session, None, None, False)
        first = self._first
        parent = first(headers, self._parent) if self._parent else None
        if parent == session:
            parent = None
        root = first(headers, self._root) if self._root else None
        final = first(headers, self._final) if self._final else None
        return _identity(session, parent, root, final is not None and final.lower() in _TRUE)


def _string_field(name: str) -> Any:
    key = name.encode()

    def read(body: ScannedBody) -> str | None:
        value = body.string(key, MAX_ID_BYTES)
        return value.strip() or None if value is not None else None

    return read


def metadata_session(body: ScannedBody) -> str | None:
    """``session_id`` of ``metadata.user_id`` (a JSON object string, or ``..._session_<id>``)."""
    span = body.member(b"metadata")
    data = body.data
    if span is None or data[span[0]] != 0x7B:  # not an object
        return None
    try:
        found = members(data, span[0], span[1], (b"user_id",))
    except RepeatedKeys:
        return None
    user_id = string_at(data, found[-1][3], found[-1][4], MAX_ID_BYTES) if found else None
    if user_id is None:
        return None
    if user_id.startswith("{"):
        try:
            parsed = orjson.loads(user_id)
        except orjson.JSONDecodeError:
            return None
        sid = parsed.get("session_id") if isinstance(parsed, dict) else None
        return sid.strip() or None if isinstance(sid, str) else None
    _, sep, sid = user_id.rpartition("_session_")
    return sid.strip() or None if sep else None


FINGERPRINT_PREFIX = "conv-"


def conversation_fingerprint(body: ScannedBody) -> str | None:
    """``conv-<32 hex>`` over the system prompt(s) and the first user message of a chat
    (``messages``, with OpenAI ``system``/``developer`` messages or an Anthropic ``system``
    field); None when the body has no user message among its first
    :data:`FINGERPRINT_MAX_MESSAGES`."""
    data = body.data
    span = body.member(b"messages")
    if span is None or data[span[0]] != 0x5B:  # not an array
        return None
    system_span = body.member(b"system")
    system: list[Any] = [] if system_span is None else [load_bounded(data, *system_span, FINGERPRINT_PARSE_BYTES)]
    found = elements(data, span[0], span[1], FINGERPRINT_MAX_MESSAGES)
    for i in range(0, len(found), 2):
        start, end = found[i], found[i + 1]
        if data[start] != 0x7B:  # not an object
            continue
        try:
            fields = members(data, start, end, _MESSAGE_KEYS)
        except RepeatedKeys:
            return None
        role = content = None
        for index, _, _, vstart, vend in fields:  # the last occurrence of each wins
            if index:
                content = (vstart, vend)
            else:
                role = string_at(data, vstart, vend, 64)
        if role == "user":
            value = None if content is None else load_bounded(data, *content, FINGERPRINT_PARSE_BYTES)
            key = orjson.dumps([system, value], option=orjson.OPT_SORT_KEYS)
            return FINGERPRINT_PREFIX + hashlib.blake2b(key, digest_size=16).hexdigest()
        if role in ("system", "developer"):
            system.append(None if content is None else load_bounded(data, *content, FINGERPRINT_PARSE_BYTES))
    return None


def conversation_session(body: ScannedBody) -> str | None:
    """The Responses API's ``conversation``: a string, or an object's ``id``."""
    span = body.member(b"conversation")
    data = body.data
    if span is None:
        return None
    if data[span[0]] == 0x7B:  # an object: {"id": ...}
        try:
            found = members(data, span[0], span[1], (b"id",))
        except RepeatedKeys:
            return None
        value = string_at(data, found[-1][3], found[-1][4], MAX_ID_BYTES) if found else None
    else:
        value = body.string(b"conversation", MAX_ID_BYTES)
    return value.strip() or None if value is not None else None


def previous_response(body: ScannedBody) -> str | None:
    """The ``previous_response_id`` of a Responses API request (one with ``input``): the id,
    ``""`` when it names none (or not as a string), None for a body that is no Responses request."""
    previous = body.string(b"previous_response_id", MAX_ID_BYTES)
    if previous is not None and previous.strip():
        return previous.strip()
    return "" if body.member(b"input") is not None else None


_MESSAGE_KEYS = (b"role", b"content")
# The top-level keys each body signal reads (the first one names the signal's value).
_BODY_KEYS = {
    "prompt_cache_key": (b"prompt_cache_key",),
    "user": (b"user",),
    "metadata.user_id": (b"metadata",),
    "conversation": (b"conversation",),
    "previous_response_id": (b"previous_response_id", b"input"),
}
_BODY_READERS = {
    "prompt_cache_key": _string_field("prompt_cache_key"),
    "user": _string_field("user"),
    "metadata.user_id": metadata_session,
    "conversation": conversation_session,
}
