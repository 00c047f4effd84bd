"""vllm-router mode.

``vllm_router`` emits ``x-session-id: <session>`` (the first header vllm-router's
``consistent_hash`` and ``sticky_least_loaded`` policies key on) and, once per ended session,
asks the router to drop the session's pin: ``POST <upstream>/finish_session?session_id=<id>``.
That call runs off the request path (bounded queue, bounded retries) and is counted in
``sidecar_end_actions_total{mode="vllm_router",outcome=ok|rejected|failed|dropped}``.
No options.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.headers import X_SESSION_ID
from sidecar.modes.base import EndAction, Mode, RoutingContext, SessionEnd

FINISH_SESSION_PATH = "/finish_session"


class VllmRouter(Mode):
    """vllm-router (consistent_hash / sticky_least_loaded): x-session-id + /finish_session."""

    name = "vllm_router"
    _EMITS = (X_SESSION_ID,)

    def emitted_headers(self) -> Sequence[str]:
        return self._EMITS

    def request_headers(self, ctx: RoutingContext) -> Sequence[tuple[str, str]]:
        return ((X_SESSION_ID, ctx.session),)

    def on_session_end(self, end: SessionEnd) -> Sequence[EndAction]:
        return (EndAction("POST", FINISH_SESSION_PATH, {"session_id": end.session}),)
