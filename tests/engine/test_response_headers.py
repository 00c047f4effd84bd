"""The response-head view the fast engine hands to ``Router.on_response`` and modes: a read-only
Mapping with the semantics of the dict it replaces (lower-case name -> first value, decoded)."""

from collections.abc import Mapping

import pytest

from sidecar.engine.fast_client import ResponseHeaders

HEADERS = [("x-worker", b"X-Worker", b"w1"), ("content-type", b"Content-Type", b"application/json"),
           ("x-worker", b"x-worker", b"w2"), ("x-raw", b"X-Raw", b"caf\xc3\xa9 \xff")]
EXPECTED = {"x-worker": "w1", "content-type": "application/json", "x-raw": "caf\u00e9 \udcff"}


def test_reads_like_the_first_value_dict() -> None:
    view = ResponseHeaders(HEADERS)
    assert isinstance(view, Mapping)
    assert view["x-worker"] == "w1" and view.get("x-worker") == "w1"
    assert view.get("x-missing") is None and view.get("x-missing", "d") == "d"
    assert "content-type" in view and "x-missing" not in view and 3 not in view
    with pytest.raises(KeyError):
        view["x-missing"]
    assert len(view) == 3 and list(view) == list(EXPECTED)
    assert dict(view) == EXPECTED and view == EXPECTED and view != {"x-worker": "w1"}
    assert list(view.keys()) == list(EXPECTED) and list(view.values()) == list(EXPECTED.values())
    assert list(view.items()) == list(EXPECTED.items())
    assert view["x-raw"].encode("utf-8", "surrogateescape") == b"caf\xc3\xa9 \xff"  # nothing lost


def test_is_read_only_and_unhashable() -> None:
    view = ResponseHeaders(HEADERS)
    with pytest.raises(TypeError):
        view["x-worker"] = "w3"  # type: ignore[index]
    with pytest.raises(TypeError):
        hash(view)
    assert ResponseHeaders([]) == {} and len(ResponseHeaders([])) == 0
