"""Fitting session ids into a gateway's id length limit.

Gateways bound the ids they accept: SMG treats a routing key longer than 128 bytes as "no key"
(the request is then routed as if it had none), Dynamo answers HTTP 400 to a session id longer
than 256 bytes. Clients are free to send longer ids (agent frameworks build ids from paths and
URLs), so modes that emit ids to those gateways pass them through :func:`fit_id`.

An id that fits is sent unchanged. A longer id becomes::

    <longest prefix of the id that fits, cut on a character boundary> "~" <digest>

where ``<digest>`` is the BLAKE2b-160 digest of the whole id's UTF-8 bytes, lower-case base32
without padding (32 characters). The mapping depends on nothing but the id, so every turn of a
session, and every sidecar replica, sends the same fitted id; 160 bits make two different long
ids colliding negligible, and the prefix keeps the id recognisable in gateway logs.
"""

from __future__ import annotations

import base64
import hashlib

SMG_MAX_KEY_BYTES = 128
DYNAMO_MAX_ID_BYTES = 256

_DIGEST_BYTES = 20  # 160 bits -> 32 base32 characters
_SUFFIX_LEN = 1 + 32  # "~" + digest
MIN_MAX_BYTES = _SUFFIX_LEN


def _digest(data: bytes) -> str:
    raw = hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()
    return base64.b32encode(raw).decode("ascii").rstrip("=").lower()


def always_fits(max_bytes: int) -> int:
    """The length (in characters) up to which every id fits ``max_bytes`` unchanged: no character
    takes more than 4 UTF-8 bytes. Per-request callers compare ``len(id)`` with it and call
    :func:`fit_id` only above it, saving a call for the ids nearly every client sends."""
    return max_bytes // 4


# Dynamo ids of at most this many characters always fit (both Dynamo modes compare with it).
DYNAMO_ALWAYS_FITS = always_fits(DYNAMO_MAX_ID_BYTES)


def opaque_id(value: str) -> str:
    """A stable form of an id that cannot travel in a header as it is (it holds a control
    character other than HTAB): ``"~"`` and the digest of the whole id."""
    return "~" + _digest(value.encode("utf-8", "surrogateescape"))


def fit_id(value: str, max_bytes: int) -> str:
    """``value`` if its UTF-8 encoding has at most ``max_bytes`` bytes, else its stable fitted form.

    The fitted form has at most ``max_bytes`` UTF-8 bytes and is a pure function of ``value``.
    """
    if len(value) * 4 <= max_bytes:  # no character takes more than 4 UTF-8 bytes: fits, skip encoding
        return value
    if max_bytes < MIN_MAX_BYTES:
        raise ValueError(f"max_bytes must be >= {MIN_MAX_BYTES} (got {max_bytes})")
    # surrogateescape: HTTP parsers hand undecodable header bytes over as lone surrogates.
    encoded = value.encode("utf-8", "surrogateescape")
    if len(encoded) <= max_bytes:
        return value
    cut = max_bytes - _SUFFIX_LEN
    while cut > 0 and encoded[cut] & 0xC0 == 0x80:  # never split a multi-byte character
        cut -= 1
    prefix = encoded[:cut].decode("utf-8", "surrogateescape")
    return f"{prefix}~{_digest(encoded)}"
