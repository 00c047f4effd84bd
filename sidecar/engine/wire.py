"""HTTP/1.1 wire constants of the fast engine, and the answers it writes itself.

Header names come from :mod:`sidecar.headers`; here they become the lower-case keys the router's
header map uses, the byte strings the head scans match, and the ready-made lines the engine
writes (built once at import: nothing on the request path formats a header name).
"""

from __future__ import annotations

from http import HTTPStatus

from sidecar import errors
from sidecar import headers as h

# Lower-case str keys (the keys of the router's header dict, and of drop sets).
CONNECTION = h.CONNECTION.lower()
CONTENT_LENGTH = h.CONTENT_LENGTH.lower()
TRANSFER_ENCODING = h.TRANSFER_ENCODING.lower()
EXPECT = h.EXPECT.lower()
UPGRADE = h.UPGRADE.lower()
XFF = h.X_FORWARDED_FOR.lower()
XFP = h.X_FORWARDED_PROTO.lower()
HOP = frozenset(n.lower() for n in h.HOP_BY_HOP)
# Never copied from the client: hop-by-hop fields, and the fields the engine writes itself from
# what it parsed (Host, the framing: Content-Length / Transfer-Encoding), so that no header
# filter (Connection tokens, a mode's drop list) can ever remove or change a message's framing.
REQUEST_DROP = HOP | {h.HOST.lower(), CONTENT_LENGTH, EXPECT, XFF}

# Lower-case names as bytes, for the scans of raw header blocks (sidecar.engine.head).
CONNECTION_B = CONNECTION.encode()
TRANSFER_ENCODING_B = TRANSFER_ENCODING.encode()
EXPECT_B = EXPECT.encode()
UPGRADE_B = UPGRADE.encode()
XFF_B = XFF.encode()
XFP_B = XFP.encode()

# Lines the engine writes.
XFF_LINE = h.X_FORWARDED_FOR.encode() + b": "
XFP_LINE = h.X_FORWARDED_PROTO.encode() + b": http\r\n"
CL_LINE = h.CONTENT_LENGTH.encode() + b": "
CL_ZERO = CL_LINE + b"0\r\n"
CHUNKED_LINE = h.TRANSFER_ENCODING.encode() + b": chunked\r\n"
CLOSE_LINE = h.CONNECTION.encode() + b": close\r\n"
KEEPALIVE_LINE = h.CONNECTION.encode() + b": keep-alive\r\n"
JSON_HEAD = h.CONTENT_TYPE.encode() + b": application/json\r\n" + CL_LINE
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"
HTTP11 = b"HTTP/1.1 "
HTTP10 = b"HTTP/1.0 "

# Methods for which the aiohttp client sends no ``Content-Length: 0`` on an empty body (parity).
NO_EMPTY_LENGTH = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE"})
# Method bytes -> the str the router gets, for the usual ones (no decode per request).
METHODS = {m.encode(): m for m in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")}
STATUS_CODE = {s.value: b"%d" % s.value for s in HTTPStatus}
STATUS_LINE = {s.value: b"%d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}


def error_response(exc: errors.ProxyError, http10: bool, keep_alive: bool, head_only: bool) -> bytes:
    """The complete JSON error answer for ``exc`` (its status and body; no body for HEAD), framed
    for the client's HTTP version and saying whether the connection stays open."""
    body = exc.body()
    parts = [
        HTTP10 if http10 else HTTP11,
        STATUS_LINE.get(exc.status) or b"%d Error\r\n" % exc.status,
        JSON_HEAD,
        b"%d" % len(body),
        b"\r\n",
    ]
    if not keep_alive:
        if not http10:  # closing is HTTP/1.0's default
            parts.append(CLOSE_LINE)
    elif http10:
        parts.append(KEEPALIVE_LINE)
    parts.append(b"\r\n")
    if not head_only:
        parts.append(body)
    return b"".join(parts)
