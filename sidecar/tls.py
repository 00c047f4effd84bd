"""Client TLS contexts of ``https://`` upstreams, built from a deployment's ``tls`` settings.

One context per deployment, built when the deployment starts and shared by everything that
talks to its upstreams (both engines, end-of-session actions, health checks). Every problem with
the settings is a :class:`~sidecar.config.ConfigError` naming the setting, so a bad certificate
stops the process at start instead of failing each request.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import NoReturn, Protocol

from sidecar.errors import ConfigError


class TlsSettings(Protocol):
    """What a context is built from: a deployment's ``tls`` settings (``sidecar.config.TlsConfig``)."""

    @property
    def ca_file(self) -> str | None: ...
    @property
    def cert_file(self) -> str | None: ...
    @property
    def key_file(self) -> str | None: ...
    @property
    def verify(self) -> bool: ...


# Both engines speak HTTP/1.1 upstream: an upstream that negotiates ALPN must not pick h2.
ALPN = ["http/1.1"]


def client_context(tls: TlsSettings | None, where: str = "") -> ssl.SSLContext:
    """The client context for ``tls`` (None: the defaults). ``where`` prefixes the setting in
    errors (``deployments[0].``).

    Defaults are the system CA bundle (OpenSSL's default locations, which ``SSL_CERT_FILE`` /
    ``SSL_CERT_DIR`` override), certificate and host name verification, TLS 1.2 or later.
    ``ca_file`` replaces the system bundle; ``verify: false`` checks nothing.
    """
    if tls is None:
        ctx = ssl.create_default_context()
        ctx.set_alpn_protocols(ALPN)
        return ctx
    prefix = f"{where}tls."
    if tls.ca_file is not None:
        readable(tls.ca_file, prefix + "ca_file")
    try:  # with a cafile, only that bundle is trusted
        ctx = ssl.create_default_context(cafile=tls.ca_file)
    except ssl.SSLError as exc:
        _fail(prefix + "ca_file", f"{tls.ca_file} holds no PEM certificate{_reason(exc)}")
    if (tls.cert_file is None) != (tls.key_file is None):
        missing, given = ("key_file", "cert_file") if tls.key_file is None else ("cert_file", "key_file")
        _fail(prefix + missing, f"required with {given} (a client certificate needs its private key)")
    if tls.cert_file is not None and tls.key_file is not None:
        readable(tls.cert_file, prefix + "cert_file")
        readable(tls.key_file, prefix + "key_file")
        try:  # a scratch context tells a bad certificate file from a bad key
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=tls.cert_file)
        except ssl.SSLError as exc:
            _fail(prefix + "cert_file", f"{tls.cert_file} holds no PEM certificate{_reason(exc)}")
        try:
            ctx.load_cert_chain(tls.cert_file, tls.key_file, password=_encrypted(prefix + "key_file"))
        except ssl.SSLError as exc:
            if exc.reason == "KEY_VALUES_MISMATCH":
                _fail(prefix + "key_file", f"{tls.key_file} is not the private key of cert_file {tls.cert_file}")
            _fail(prefix + "key_file", f"{tls.key_file} holds no usable PEM private key{_reason(exc)}")
    if not tls.verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(ALPN)
    return ctx


class RefusedAfterHandshake(ssl.SSLError):
    """A TLS 1.3 upstream ended a new connection after the handshake without an alert, before
    confirming the session: how servers on asyncio's TLS (aiohttp, uvicorn) refuse a client
    certificate, which TLS 1.3 checks only once the client's side of the handshake is done."""

    reason = "closed by the upstream after the handshake (no alert)"


def refused_after_handshake(transport: asyncio.BaseTransport | None) -> RefusedAfterHandshake | None:
    """The refusal of the TLS session of ``transport``, a new connection that ended (closed or
    reset, no alert read) before any byte of a response; None if it was refused nothing.

    Only TLS 1.3 leaves a refusal to after the client's handshake, and a server that accepted
    the session sends its session tickets at once: a connection that carried a ticket, or TLS
    1.2, was refused nothing. (A server without tickets that closed right after accepting
    cannot be told apart: it counts as a refusal.) An alert that a reset overtook (the kernel
    drops unread bytes when a reset arrives) is found here too, without its name.
    """
    sslobj = transport.get_extra_info("ssl_object") if transport is not None else None
    if sslobj is None or sslobj.version() != "TLSv1.3":
        return None
    session = sslobj.session
    if session is not None and session.has_ticket:
        return None
    return RefusedAfterHandshake(RefusedAfterHandshake.reason)


def check_ca_file(path: str, setting: str) -> None:
    """``path`` is a readable CA bundle holding a PEM certificate; a ConfigError naming ``setting`` if not."""
    readable(path, setting)
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError as exc:
        _fail(setting, f"{path} holds no PEM certificate{_reason(exc)}")


def readable(path: str, setting: str) -> None:
    """``path`` can be read; a ConfigError naming ``setting`` if not."""
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        _fail(setting, f"cannot read {path}: {exc.strerror or exc}")


def _encrypted(setting: str) -> Callable[[], NoReturn]:
    """A password callback that refuses: without one, OpenSSL would prompt on the terminal."""

    def refuse() -> NoReturn:
        raise ConfigError(
            f"{setting}: the private key is encrypted; give it unencrypted (as a Kubernetes TLS Secret holds it)"
        )

    return refuse


def _reason(exc: ssl.SSLError) -> str:
    """`` (OPENSSL_REASON)`` when OpenSSL gave one."""
    return f" ({exc.reason})" if exc.reason else ""


def _fail(setting: str, message: str) -> NoReturn:
    raise ConfigError(f"{setting}: {message}")
