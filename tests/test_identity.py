"""Session identity signals: order, configuration, finality parsing."""

from __future__ import annotations

from multidict import CIMultiDict

from sidecar.config import IdentityConfig
from sidecar.identity import IdentityReader


def read(headers: dict[str, str], **cfg: object):
    return IdentityReader(IdentityConfig(**cfg)).read(CIMultiDict(headers))


def test_first_present_signal_wins_in_configured_order():
    h = {"X-Session-ID": "c", "X-Session-Affinity": "b", "X-Correlation-ID": "a"}
    assert read(h).session == "a"
    assert read({"X-Session-ID": "c", "X-Session-Affinity": "b"}).session == "b"
    assert read(h, session="X-Session-ID, X-Correlation-ID").session == "c"


def test_empty_values_are_skipped_and_values_trimmed():
    assert read({"X-Correlation-ID": "  ", "X-Session-Affinity": " s1 "}).session == "s1"


def test_no_session_signal_means_no_session():
    ident = read({"X-Request-ID": "r1", "X-Parent-Session-ID": "p"})
    assert ident.session is None and ident.parent is None


def test_parent_root_and_final():
    ident = read(
        {
            "X-Correlation-ID": "s",
            "X-Dynamo-Parent-Session-ID": "p",
            "X-Root-Session-ID": "r",
            "x-dynamo-session-final": "TRUE",
        }
    )
    assert (ident.session, ident.parent, ident.root, ident.final) == ("s", "p", "r", True)
    assert read({"X-Correlation-ID": "s", "X-Session-Final": "false"}).final is False
    assert read({"X-Correlation-ID": "s", "X-Session-Final": "1"}).final is True


def test_parent_equal_to_session_is_ignored():
    assert read({"X-Correlation-ID": "s", "X-Parent-Session-ID": "s"}).parent is None
