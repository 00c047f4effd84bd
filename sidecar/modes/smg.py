"""SGLang / Shepherd Model Gateway (SMG) mode.

``smg_routing_key`` emits ``X-SMG-Routing-Key: <id>`` with ``<id>`` the session id
(``scope: session``, the default) or its tree's root id (``scope: tree``). SMG honours the key
only under ``--policy manual``, ``--policy consistent_hashing`` or with ``--sticky-sessions``;
its default ``cache_aware`` policy ignores it. SMG treats a key longer than 128 bytes as no key,
so longer ids are fitted (:mod:`sidecar.modes.ids`).
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.headers import X_SMG_ROUTING_KEY
from sidecar.modes.base import Mode, RoutingContext
from sidecar.modes.ids import SMG_MAX_KEY_BYTES, fit_id
from sidecar.modes.options import Scoped


class SmgRoutingKey(Mode):
    """SMG (--policy manual / consistent_hashing / --sticky-sessions): X-SMG-Routing-Key."""

    name = "smg_routing_key"
    Options = Scoped
    options: Scoped
    _EMITS = (X_SMG_ROUTING_KEY,)

    def emitted_headers(self) -> Sequence[str]:
        return self._EMITS

    def request_headers(self, ctx: RoutingContext) -> Sequence[tuple[str, str]]:
        key = ctx.root if self.options.scope == "tree" else ctx.session
        return ((X_SMG_ROUTING_KEY, fit_id(key, SMG_MAX_KEY_BYTES)),)
