"""What the fast engine's HTTP/1.1 parsers raise (both builds; see :mod:`sidecar.engine.parsers`)."""

from __future__ import annotations

# Why a response is refused whose body is framed by a transfer coding besides chunked (both engines).
UNSUPPORTED_CODING = "unsupported Transfer-Encoding (only chunked)"


class ParseError(Exception):
    """llhttp refused the bytes (the message is llhttp's reason)."""


class HeadTooLarge(ParseError):
    """A request head, or a request's trailers, exceeds the head limit."""


class Http09Request(ParseError):
    """A request line without an HTTP version (or with version 0.9), raised as soon as the line
    ended: llhttp would read such a request's header lines until an empty line that an HTTP/0.9
    client never sends."""


class CallbackError(ParseError):
    """An owner callback raised (the cause): a defect, not the client's."""


class UpgradeRequest(Exception):
    """The head just handed to the owner asks for a protocol switch (Upgrade or CONNECT)."""
