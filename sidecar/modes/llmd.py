"""llm-d inference scheduler mode.

llm-d's endpoint picker answers a session's request with an ``x-session-token`` response header
that the client must echo on the session's later requests to stay on the same endpoint. Clients
rarely do; ``llmd_session_token`` remembers the latest token per session (bounded with the
session in the lineage tree) and echoes it as ``x-session-token`` on every later request of that
session. The first request of a session carries no token. No options.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sidecar.headers import X_SESSION_TOKEN, X_SESSION_TOKEN_L
from sidecar.modes.base import Mode, RoutingContext

# The picker's tokens are short opaque strings; anything longer is not a token we should echo.
MAX_TOKEN_BYTES = 4096


class LlmdSessionToken(Mode):
    """llm-d endpoint picker: echoes the x-session-token it answered with."""

    name = "llmd_session_token"
    _EMITS = (X_SESSION_TOKEN,)

    def emitted_headers(self) -> Sequence[str]:
        return self._EMITS

    def request_headers(self, ctx: RoutingContext) -> Sequence[tuple[str, str]]:
        if ctx.mode_state is None:
            return ()
        return ((X_SESSION_TOKEN, ctx.mode_state),)

    def on_response(self, ctx: RoutingContext, headers: Mapping[str, str]) -> str | None:
        token = headers.get(X_SESSION_TOKEN_L)
        if token is None:
            return None
        token = token.strip()
        if not token or len(token.encode("utf-8", "surrogateescape")) > MAX_TOKEN_BYTES:
            return None
        return token
