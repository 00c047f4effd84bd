"""The request-head rules, for both engines: what a head their parser accepted must also satisfy
to be proxied, and the answer to one that does not (400, or 501 for an upgrade).

- the version: HTTP/1.0 or 1.1 (a request line without a version, HTTP/0.9, is refused by the
  parsers as soon as it ends, with the same answer);
- one valid Host (``uri-host[:port]``), required in HTTP/1.1 (RFC 9112 3.2);
- the framing: a lone ``chunked`` Transfer-Encoding, on HTTP/1.1 only (the engines forward no
  other coding faithfully: RFC 9112 6.1, 6.3);
- no protocol upgrade (``Connection: upgrade`` with an ``Upgrade`` header);
- the target: origin-form (``/path``) or absolute-form (forwarded in origin-form), no CONNECT,
  no ``.`` or ``..`` path segment (:func:`~sidecar.engine.head.dot_segment`).

The fast engine checks a head with :func:`check` only when its one scan of the head says it may
fail one (:func:`plain` is False); the aiohttp engine checks every head.
"""

from __future__ import annotations

from sidecar import errors
from sidecar.engine.head import (
    DOT_SEGMENT,
    HOST_INVALID,
    HOST_REPEATED,
    HOST_SEEN,
    LISTED,
    dot_segment,
    origin_form,
    valid_host,
)

Refusal = tuple[errors.ProxyError, str]  # the error that answers it, the label it is counted under
_HOST_BITS = HOST_SEEN | HOST_REPEATED | HOST_INVALID
_BAD_TARGET = "request target must be origin-form (/path) or absolute-form (http://host/path)"


def plain(keep_alive: bool, head_bits: int, method: bytes, target: bytes) -> bool:
    """Whether a head passes every rule without :func:`check`, from the fast engine's cheap facts
    (``head_bits``: its :func:`~sidecar.engine.head.scan_request` bits, LISTED for a framing,
    Connection or forwarding header). Without a Connection header, llhttp keeps a request alive
    only for HTTP/1.1: the common case (one valid Host, origin-form) needs no further check."""
    return (
        keep_alive
        and not head_bits & LISTED
        and head_bits & _HOST_BITS == HOST_SEEN
        and len(target) > 0
        and target[0] == 47  # "/..."
        and method != b"CONNECT"
        and not dot_segment(target)
    )


def host_bits(hosts: list[bytes]) -> int:
    """The Host bits :func:`check` takes, from a head's Host values."""
    head_bits = 0
    for value in hosts:
        head_bits |= HOST_REPEATED if head_bits & HOST_SEEN else HOST_SEEN
        if not valid_host(value, 0, len(value)):
            head_bits |= HOST_INVALID
    return head_bits


def check(
    version: int, head_bits: int, codings: list[bytes], upgrade: bool, method: bytes, target: bytes
) -> tuple[bytes, Refusal | None]:
    """The target to forward (origin-form) and the refusal of the head, if any. ``version``:
    ``10 * major + minor``; ``head_bits``: its Host bits (:func:`host_bits`); ``codings``: its
    Transfer-Encoding values; ``upgrade``: it asks for one (an Upgrade header that its
    Connection header names)."""
    if version != 11 and version != 10:
        return target, version_refusal(version)
    if head_bits & HOST_REPEATED or head_bits & HOST_INVALID or not (head_bits & HOST_SEEN or version == 10):
        problem = (
            "more than one Host header"
            if head_bits & HOST_REPEATED
            else "invalid Host header (uri-host[:port] expected)"
            if head_bits & HOST_INVALID
            else "missing Host header (required in HTTP/1.1)"
        )
        return target, (errors.bad_request(problem), "bad_request")
    if codings and (version == 10 or not lone_chunked(codings)):
        return target, (errors.unsupported_transfer_coding(), "bad_request")
    if upgrade:  # the rest of the stream would belong to another protocol
        return target, (errors.upgrade_not_supported(), "upgrade")
    if method != b"CONNECT" and not target.startswith(b"/"):
        origin = origin_form(target)  # absolute-form: forwarded in origin-form
        if origin is not None:
            target = origin
    if method == b"CONNECT" or not target.startswith(b"/"):
        return target, (errors.bad_request(_BAD_TARGET), "bad_request")
    if dot_segment(target):
        return target, (errors.bad_request(DOT_SEGMENT), "bad_request")
    return target, None


def version_refusal(version: int) -> Refusal:
    """The refusal of a request in another version than 1.0 and 1.1 (``10 * major + minor``; 9
    for a request line that ended without one, which the parsers report as soon as it ends)."""
    return errors.unsupported_version(version // 10, version % 10), "bad_request"


def lone_chunked(values: list[bytes]) -> bool:
    """Whether Transfer-Encoding ``values`` are ``chunked`` alone, the one coding either engine
    relays, in requests and responses (the usual single ``chunked`` without a strip and a copy)."""
    if len(values) == 1 and values[0] == b"chunked":
        return True
    return len(values) == 1 and values[0].strip().lower() == b"chunked"
