"""Header names used by the sidecar, in one place (compare case-insensitively: use the ``*_L``
forms), and :func:`lookup`, how the router reads a head's headers by name."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Inbound session identity.
X_CORRELATION_ID = "X-Correlation-ID"
X_SESSION_AFFINITY = "X-Session-Affinity"
X_SESSION_ID = "X-Session-ID"
X_PARENT_SESSION_ID = "X-Parent-Session-ID"
X_ROOT_SESSION_ID = "X-Root-Session-ID"
X_SESSION_FINAL = "X-Session-Final"
X_DYNAMO_SESSION_FINAL = "X-Dynamo-Session-Final"
X_REQUEST_ID = "X-Request-ID"

# Outbound gateway headers.
X_DYNAMO_SESSION_ID = "X-Dynamo-Session-ID"
X_DYNAMO_PARENT_SESSION_ID = "X-Dynamo-Parent-Session-ID"
X_SMG_ROUTING_KEY = "X-SMG-Routing-Key"
X_SMG_ROUTED_WORKER_ID = "x-smg-routed-worker-id"

# Explicit deployment selector (config `deployment_header`); never forwarded upstream.
X_SIDECAR_DEPLOYMENT = "X-Sidecar-Deployment"

# Proxy headers.
X_FORWARDED_FOR = "X-Forwarded-For"
X_FORWARDED_PROTO = "X-Forwarded-Proto"
CONNECTION = "Connection"
CONTENT_LENGTH = "Content-Length"
CONTENT_TYPE = "Content-Type"
CONTENT_ENCODING = "Content-Encoding"
TRANSFER_ENCODING = "Transfer-Encoding"
HOST = "Host"
EXPECT = "Expect"
UPGRADE = "Upgrade"
AUTHORIZATION = "Authorization"
WWW_AUTHENTICATE = "WWW-Authenticate"
LOCATION = "Location"
RETRY_AFTER = "Retry-After"
ALLOW = "Allow"

# RFC 9110 section 7.6.1 hop-by-hop fields, plus the legacy ones every proxy drops.
HOP_BY_HOP: frozenset[str] = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


# Fields the proxy writes itself, from what it parsed or decided: no routing mode, identity
# signal or Connection token may add, remove or replace them (a mode emitting Content-Length
# would reframe the message; one emitting Connection would change hop-by-hop handling).
FRAMING: frozenset[str] = frozenset({"content-length", "transfer-encoding"})
PROXY_OWNED: frozenset[str] = HOP_BY_HOP | FRAMING | frozenset({"host", "content-type", "content-encoding", "expect"})


def is_field_value(value: str) -> bool:
    """``value`` can be sent as a header field value (RFC 9110 5.5): no control character but
    HTAB. CR, LF and NUL would end the field or the head early (header injection); the others
    are refused by strict parsers, this sidecar's own included."""
    for ch in value:
        if (ch < " " and ch != "\t") or ch == "\x7f":
            return False
    return True


class HeaderView:
    """A head's headers as an engine hands them to the router, by lower-case name (first value).
    Compiled, an extension type: the fast engine's :class:`~sidecar.engine.head.HeaderBlock`
    implements ``get`` in C, and :func:`lookup` reaches it without a Python-level call."""

    __slots__ = ()

    def get(self, key: str, default: Any = None) -> Any:
        raise NotImplementedError


def lookup(headers: Mapping[str, str], name: str) -> str | None:
    """``headers.get(name)``. Compiled, a C call when ``headers`` is a :class:`HeaderView`: the
    router and the identity reader look up several names per request, most of them absent, and a
    Python-level method call costs more than an absent name's lookup."""
    if isinstance(headers, HeaderView):
        view = headers
        return view.get(name)
    return headers.get(name)


def connection_tokens(values: Iterable[str]) -> frozenset[str]:
    """Lower-cased field names listed in the values of a message's ``Connection`` header lines
    (they are hop-by-hop too; every line counts, as for any list-valued field)."""
    return frozenset(t.strip().lower() for value in values for t in value.split(",") if t.strip())


# Session signals of coding-agent clients (identity.clients; docs/reference.md, per client).
# Claude Code: the main conversation on every request; a sub-agent's own id (not scoped by the
# conversation); a nested sub-agent's parent agent.
X_CLAUDE_CODE_SESSION_ID = "x-claude-code-session-id"
X_CLAUDE_CODE_AGENT_ID = "x-claude-code-agent-id"
X_CLAUDE_CODE_PARENT_AGENT_ID = "x-claude-code-parent-agent-id"
# Codex CLI: the main thread on every request (the tree's root), the agent's own thread, a
# sub-agent's parent thread.
CODEX_SESSION_ID = "session-id"
CODEX_THREAD_ID = "thread-id"
X_CODEX_PARENT_THREAD_ID = "x-codex-parent-thread-id"

# llm-d endpoint picker session token (response header the client must echo).
X_SESSION_TOKEN = "x-session-token"
X_SESSION_TOKEN_L = X_SESSION_TOKEN.lower()
