"""Which session, parent, root and final-turn flag a request declares (SPEC section 2).

Each is an ordered list of header signals; the first one present with a non-empty value wins.
Header signals never touch the body.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sidecar.config import IdentityConfig

_TRUE = frozenset({"true", "1", "yes", "on"})


@dataclass(frozen=True, slots=True)
class Identity:
    """A request's declared identity; ``session is None`` means "not part of a session"."""

    session: str | None
    parent: str | None = None
    root: str | None = None
    final: bool = False


NO_SESSION = Identity(session=None)


class IdentityReader:
    """Reads :class:`Identity` from a request's headers, by the configured ordered signals."""

    __slots__ = ("_session", "_parent", "_root", "_final", "header_names")

    def __init__(self, cfg: IdentityConfig) -> None:
        self._session = tuple(n.lower() for n in cfg.session)
        self._parent = tuple(n.lower() for n in cfg.parent)
        self._root = tuple(n.lower() for n in cfg.root)
        self._final = tuple(n.lower() for n in cfg.final)
        # Every header the reader consumes (lower-case), for engines that index only these.
        self.header_names = frozenset(self._session + self._parent + self._root + self._final)

    @staticmethod
    def _first(headers: Mapping[str, str], names: tuple[str, ...]) -> str | None:
        for name in names:
            value = headers.get(name)
            if value:
                value = value.strip()
                if value:
                    return value
        return None

    def read(self, headers: Mapping[str, str]) -> Identity:
        """``headers`` maps lower-case names to values (first occurrence)."""
        session = self._first(headers, self._session)
        if session is None:
            return NO_SESSION
        parent = self._first(headers, self._parent)
        if parent == session:
            parent = None
        final = self._first(headers, self._final)
        return Identity(
            session=session,
            parent=parent,
            root=self._first(headers, self._root),
            final=final is not None and final.lower() in _TRUE,
        )
