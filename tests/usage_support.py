"""The engines' side of prompt-cache accounting, played in a test: one request of a session through
the router's interface exactly as an engine drives it (``Router.admit``, the response head, the
usage reader fed the body's first reads and last bytes, ``Admission.on_usage``,
``Admission.finish``), for the tests of what lies behind that interface (the tree, the store, the
views, the metrics). The wire tests (tests/test_usage_wire.py) check the same through the
engines."""

from __future__ import annotations

from typing import Any

from sidecar.context import TurnOutcome
from sidecar.router import LOAD, READY, Admission, RequestHead, Router
from sidecar.usage import LAST_BYTES


async def play_turn(
    router: Router,
    session: str,
    body: bytes,
    *,
    parent: str | None = None,
    content_type: str = "text/event-stream",
    status: int = 200,
    encoding: str | None = None,
    read_size: int = 512,
    extra_headers: dict[str, str] | None = None,
) -> Admission:
    """One request of ``session`` (child of ``parent``) answered ``status`` with ``body``;
    returns its admission, finished."""
    headers = {"x-correlation-id": session, "content-length": "2", **(extra_headers or {})}
    if parent is not None:
        headers["x-parent-session-id"] = parent
    adm = router.admit(RequestHead("POST", headers, b"/v1/chat/completions"))
    if adm.need == LOAD:
        assert adm.identity is not None
        await router.state.load(adm.identity)
        adm.loaded()
    assert adm.need == READY, adm.error
    response: dict[str, Any] = {"content-type": content_type}
    if encoding is not None:
        response["content-encoding"] = encoding
    adm.on_response(status, response)
    reader = adm.usage_reader(status, response, False)
    if reader is not None:
        at = 0
        while at < len(body) and not reader.first(body[at : at + read_size]):
            at += read_size
        reader.last(body[-LAST_BYTES:], len(body))
        adm.on_usage(reader.result())
    adm.finish(TurnOutcome.COMPLETED)
    return adm
