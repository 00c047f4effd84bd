"""The routing core, put together once in dependency order: the identity reader, the deployments
(with their metric children), the session tree and the API session table, the funnel every
session end goes through, where sessions live (this process, or a shared store), and the router
over all of them. Each part receives what it needs when it is built: nothing is wired after.
The app builds its router here; so do tests and benchmarks that drive a router directly."""

from __future__ import annotations

import time

from sidecar.config import Config
from sidecar.deployments import Deployment
from sidecar.identity import IdentityReader
from sidecar.lineage import Clock, SessionTree
from sidecar.metrics import Metrics
from sidecar.router import Router
from sidecar.session_ends import EndActionSink, SessionEnds
from sidecar.sessions import SessionStore
from sidecar.state import MemoryState, SessionState


def routing_core(
    config: Config,
    metrics: Metrics,
    *,
    send: EndActionSink | None = None,
    session_clock: Clock = time.time,
    tree_clock: Clock = time.monotonic,
) -> Router:
    """The router for ``config``. ``send`` takes the end actions of ended sessions (the app's
    end-action runner; None: they are dropped, as in a router driven without I/O);
    ``session_clock`` is the API sessions' wall clock, ``tree_clock`` the session tree's (tests
    inject both)."""
    identity = IdentityReader(config.identity, config.sessions.max_id_bytes)
    s = config.sessions
    deployments = [
        Deployment.from_config(
            d,
            selector_header=config.deployment_header,
            identity_headers=identity.header_names,
            max_overrides=s.max_live_sessions,
            stats=metrics.for_deployment,
        )
        for d in config.resolved_deployments()
    ]
    tree = SessionTree(
        idle_ttl=s.idle_ttl_seconds,
        max_live=s.max_live_sessions,
        tombstone_max=s.tombstone_max,
        tombstone_ttl=s.tombstone_ttl_seconds,
        shared=config.state.shared,
        clock=tree_clock,
    )
    api = SessionStore(s.api, clock=session_clock)
    ends = SessionEnds(metrics, deployments, tree, send)
    state: SessionState
    if config.state.shared:
        from sidecar.state.redis import RedisState  # (redis-py: only where a store is configured)

        state = RedisState(config, metrics, tree, api, ends)
    else:
        state = MemoryState(config, ends)
    return Router(config, metrics, identity=identity, deployments=deployments, tree=tree, store=api, state=state)
