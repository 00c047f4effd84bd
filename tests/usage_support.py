"""The engines' side of prompt-cache accounting, played in a test: one request of a session through
the router's interface exactly as an engine drives it (``Router.route``, the response head, the
usage reader fed the body's first reads and last bytes, ``Router.on_usage``, ``Router.finish``),
for the tests of what lies behind that interface (the tree, the store, the views, the metrics)
while the engines do not feed it yet. The wire tests (tests/test_usage_wire.py) check the same
through the engines."""

from __future__ import annotations

from typing import Any

from sidecar.context import TurnOutcome
from sidecar.router import Decision, RequestHead, Router
from sidecar.state import LoadNeeded
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
) -> Decision:
    """One request of ``session`` (child of ``parent``) answered ``status`` with ``body``;
    returns its decision, finished."""
    headers = {"x-correlation-id": session, "content-length": "2", **(extra_headers or {})}
    if parent is not None:
        headers["x-parent-session-id"] = parent
    head = RequestHead("POST", headers)
    try:
        decision = router.route(head)
    except LoadNeeded as need:
        await router.state.load(need.identity)
        decision = router.route(head, loaded=True)
    response: dict[str, Any] = {"content-type": content_type}
    if encoding is not None:
        response["content-encoding"] = encoding
    router.on_response(decision, status, response)
    reader = router.usage_reader(decision, status, response, False)
    if reader is not None:
        at = 0
        while at < len(body) and not reader.first(body[at : at + read_size]):
            at += read_size
        reader.last(body[-LAST_BYTES:], len(body))
        router.on_usage(decision, reader.result())
    router.finish(decision, TurnOutcome.COMPLETED)
    return decision
