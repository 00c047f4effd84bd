"""Which session, parent, root and final-turn flag a request declares (SPEC section 2).

Each is an ordered list of header signals; the first one present with a non-empty value wins.
Header signals never touch the body. When configured, body signals name the session of a
request whose headers name none (the router then parses the body once; see
:meth:`IdentityReader.read_body`):

- ``prompt_cache_key``, ``user``: OpenAI-compatible chat / responses body fields.
- ``metadata.user_id``: Anthropic-style ``/v1/messages`` bodies (Claude Code), whose
  ``metadata.user_id`` is a JSON object string carrying ``session_id`` (older clients: a string
  ending in ``_session_<id>``).
- ``fingerprint``: a stable hash of the system prompt and the first user message, identical on
  every turn of one conversation (each turn resends the whole history) and different across
  conversations that start differently.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from sidecar import headers as h
from sidecar.config import IdentityConfig
from sidecar.modes.ids import fit_id, opaque_id

_TRUE = frozenset({"true", "1", "yes", "on"})


# Not frozen: a frozen dataclass costs ~0.5 us more per construction (once per request with a session).
# Treat it as read-only (NO_SESSION is shared by every request without one). No slots=True:
# compiled (identity.pxd), it is an extension type with fixed fields.
@dataclass
class Identity:
    """A request's declared identity; ``session is None`` means "not part of a session"."""

    session: str | None
    parent: str | None = None
    root: str | None = None
    final: bool = False


NO_SESSION = Identity(session=None)


class IdentityReader:
    """Reads :class:`Identity` from a request's headers, by the configured ordered signals."""

    __slots__ = ("_session", "_parent", "_root", "_final", "_lineage", "_body", "_fingerprint",
                 "header_names", "reads_body", "_max_id_bytes", "_fits")

    def __init__(self, cfg: IdentityConfig, max_id_bytes: int = 512) -> None:
        # Ids longer than this many UTF-8 bytes are fitted (sidecar.modes.ids): up to _fits
        # characters every id fits, and the common id costs one length check.
        self._max_id_bytes = max_id_bytes
        self._fits = max_id_bytes // 4
        self._body = tuple(cfg.body)
        self._fingerprint = cfg.fingerprint
        # Whether a request whose headers name no session must have its body parsed.
        self.reads_body = cfg.reads_body
        self._session = tuple(n.lower() for n in cfg.session)
        self._parent = tuple(n.lower() for n in cfg.parent)
        self._root = tuple(n.lower() for n in cfg.root)
        self._final = tuple(n.lower() for n in cfg.final)
        # Every lineage signal (parent, root, final), for the one scan that usually finds none.
        self._lineage = self._parent + self._root + self._final
        # Every header the reader consumes (lower-case), for engines that index only these.
        self.header_names = frozenset(self._session + self._parent + self._root + self._final)

    def _first(self, headers: Mapping[str, str], names: tuple[str, ...]) -> str | None:
        get = headers.get
        for name in names:
            value = get(name)
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
        if not h.is_field_value(value):
            value = opaque_id(value)
        return value

    def read(self, headers: Mapping[str, str]) -> Identity:
        """``headers`` maps lower-case names to values (first occurrence)."""
        # Flattened: this runs once per request (the common miss costs one dict.get per name).
        get = headers.get
        for name in self._session:
            value = get(name)
            if value:
                value = value.strip()
                if value:
                    return self._with_session(headers, value)
        return NO_SESSION

    def read_body(self, headers: Mapping[str, str], body: Any) -> Identity:
        """The identity of a request whose headers named no session, from its parsed ``body``
        by the configured body signals (parent, root and final still come from headers)."""
        if not isinstance(body, dict):
            return NO_SESSION
        for signal in self._body:
            session = _BODY_READERS[signal](body)
            if session:
                return self._with_session(headers, session)
        if self._fingerprint:
            session = conversation_fingerprint(body)
            if session:
                return self._with_session(headers, session)
        return NO_SESSION

    def _with_session(self, headers: Mapping[str, str], session: str) -> Identity:
        # Flattened: most requests carry no lineage header, and one scan settles that without a
        # call per signal (Identity is built positionally: cheaper than by keyword).
        session = self._bounded(session)
        get = headers.get
        for name in self._lineage:
            if get(name):
                break
        else:
            return Identity(session, None, None, False)
        first = self._first
        parent = first(headers, self._parent) if self._parent else None
        if parent == session:
            parent = None
        root = first(headers, self._root) if self._root else None
        final = first(headers, self._final) if self._final else None
        return Identity(session, parent, root, final is not None and final.lower() in _TRUE)


def _string_field(name: str) -> Any:
    def read(body: dict[str, Any]) -> str | None:
        value = body.get(name)
        return value.strip() or None if isinstance(value, str) else None

    return read


def metadata_session(body: dict[str, Any]) -> str | None:
    """``session_id`` of ``metadata.user_id`` (a JSON object string, or ``..._session_<id>``)."""
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(user_id, str):
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


def conversation_fingerprint(body: dict[str, Any]) -> str | None:
    """``conv-<32 hex>`` over the system prompt(s) and the first user message of a chat
    (``messages``, with OpenAI ``system``/``developer`` messages or an Anthropic ``system``
    field); None when the body has no user message."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    system: list[Any] = [body["system"]] if "system" in body else []
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if role == "user":
            key = orjson.dumps([system, message.get("content")], option=orjson.OPT_SORT_KEYS)
            return FINGERPRINT_PREFIX + hashlib.blake2b(key, digest_size=16).hexdigest()
        if role in ("system", "developer"):
            system.append(message.get("content"))
    return None


_BODY_READERS = {
    "prompt_cache_key": _string_field("prompt_cache_key"),
    "user": _string_field("user"),
    "metadata.user_id": metadata_session,
}
