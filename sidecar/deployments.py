"""Runtime deployments: upstream targets, their mode instance, and which upstream serves a tree."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from yarl import URL

from sidecar.config import DeploymentConfig, LimitsConfig, TimeoutsConfig
from sidecar.modes.base import Mode
from sidecar.modes.registry import load_mode


@dataclass(frozen=True, slots=True)
class Upstream:
    """One upstream base URL, pre-split for the engines."""

    url: str
    scheme: str
    host: str
    port: int
    base_path: str  # "" or "/prefix" without a trailing slash
    host_header: str  # value of the Host header sent upstream

    @classmethod
    def parse(cls, url: str) -> Upstream:
        u = URL(url)
        assert u.host is not None and u.port is not None
        default_port = 443 if u.scheme == "https" else 80
        host_header = u.host if u.port == default_port else f"{u.host}:{u.port}"
        if ":" in u.host:
            host_header = f"[{u.host}]" if u.port == default_port else f"[{u.host}]:{u.port}"
        return cls(url=url, scheme=u.scheme, host=u.host, port=u.port,
                   base_path=u.raw_path.rstrip("/"), host_header=host_header)


@dataclass(slots=True)
class Deployment:
    """A configured deployment with its mode instantiated."""

    name: str
    mode: Mode | None
    mode_name: str  # "none" when no mode: a closed label value
    upstreams: tuple[Upstream, ...]
    trust_client_headers: bool
    strict: bool
    reject_non_object_body: bool
    timeouts: TimeoutsConfig
    limits: LimitsConfig
    models: frozenset[str]
    # Lower-case names of client headers to drop because the mode emits its own.
    strip_headers: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_config(cls, cfg: DeploymentConfig) -> Deployment:
        mode = load_mode(cfg.mode).from_options(cfg.mode_options) if cfg.mode else None
        strip = frozenset()
        if mode is not None and not cfg.trust_client_headers:
            strip = frozenset(n.lower() for n in mode.emitted_headers())
        return cls(
            name=cfg.name,
            mode=mode,
            mode_name=cfg.mode or "none",
            upstreams=tuple(Upstream.parse(u) for u in cfg.upstreams),
            trust_client_headers=cfg.trust_client_headers,
            strict=cfg.strict,
            reject_non_object_body=cfg.non_object_body == "reject",
            timeouts=cfg.timeouts,
            limits=cfg.limits,
            models=frozenset(cfg.models),
            strip_headers=strip,
        )

    def pick_upstream(self, key: str | None) -> Upstream:
        """Rendezvous (highest-random-weight) choice by ``key`` (the tree's root id).

        Every sidecar replica computes the same ranking without shared state.
        """
        if len(self.upstreams) == 1 or key is None:
            return self.upstreams[0]
        return max(self.upstreams, key=lambda u: _weight(u.url, key))


def _weight(url: str, key: str) -> bytes:
    return hashlib.blake2b(f"{url}\x00{key}".encode(), digest_size=8).digest()
