"""The one way a session's end runs, whatever ended it (a final turn, the sessions API, an idle
expiry, an eviction, the shutdown, or a shared store's claim): counted, the deployment's mode
asked for its end actions, those handed to the end-action runner, and the tree's upstream
override forgotten once its tree is gone. Synchronous and without I/O: the runner sends the
actions (:mod:`sidecar.end_actions`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from sidecar.context import SessionEnd
from sidecar.deployments import Deployment
from sidecar.lineage import SessionTree
from sidecar.metrics import Metrics
from sidecar.modes.base import EndAction

log = logging.getLogger("sidecar.router")

# Takes one end action of a session: (deployment, action, tree root, called once it ran or was
# given up, or None). The end-action runner's ``submit``.
EndActionSink = Callable[[Deployment, EndAction, str, "Callable[[], None] | None"], None]


class SessionEnds:
    """Runs session ends (:meth:`run`), once each: the caller guarantees the once (the tree
    ends a session once; a shared store hands a claim to one replica)."""

    def __init__(
        self, metrics: Metrics, deployments: Sequence[Deployment], tree: SessionTree, send: EndActionSink | None
    ) -> None:
        self.metrics = metrics
        self._by_name = {d.name: d for d in deployments}
        self.tree = tree
        self.send = send

    def run(self, e: SessionEnd, ran: Callable[[], None] | None = None) -> None:
        """End ``e``: count it, run its deployment's ``on_session_end`` and send the end actions
        it returns, forget its tree's upstream override. ``ran`` is called once every end action
        ran or was given up (at once when there are none): a shared store confirms its claim of
        the end then."""
        dep = self._by_name.get(e.deployment)
        # The label only takes configured names (a closed set).
        self.metrics.sessions_ended.labels(dep.name if dep is not None else "unknown", str(e.reason)).inc()
        actions = self._actions(e, dep)
        if actions and dep is not None and self.send is not None:
            each = None if ran is None else _AllRan(len(actions), ran)
            for action in actions:
                self.send(dep, action, e.root, each)
        elif ran is not None:
            ran()
        if dep is not None and dep.balancer.overrides and self.tree.get(e.root) is None:
            dep.balancer.forget(e.root)  # the tree is gone

    def _actions(self, e: SessionEnd, dep: Deployment | None) -> tuple[EndAction, ...]:
        if dep is None or dep.mode is None:
            return ()
        try:
            return tuple(dep.mode.on_session_end(e))
        except Exception as exc:  # a broken hook never stops cleanup of other sessions
            self.metrics.plugin_errors.labels(dep.mode_name, "on_session_end").inc()
            log.error(
                "mode %s failed in on_session_end: %r",
                dep.mode_name,
                exc,
                extra={"deployment": dep.name, "mode": dep.mode_name, "hook": "on_session_end"},
            )
            return ()


class _AllRan:
    """Calls ``ran`` when it was itself called ``n`` times: once per end action of a session."""

    __slots__ = ("n", "ran")

    def __init__(self, n: int, ran: Callable[[], None]) -> None:
        self.n = n
        self.ran = ran

    def __call__(self) -> None:
        self.n -= 1
        if self.n == 0:
            self.ran()
