"""Runtime deployments: upstream targets, their mode instance, and which upstream serves a tree."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from yarl import URL

from sidecar.balancer import Balancer
from sidecar.config import DeploymentConfig, HealthCheckConfig, LimitsConfig, TimeoutsConfig
from sidecar.metrics import DeploymentStats
from sidecar.modes.base import Mode
from sidecar.modes.registry import load_mode
from sidecar.tls import client_context

log = logging.getLogger("sidecar.deployments")


@dataclass(frozen=True, slots=True)
class Upstream:
    """One upstream base URL, pre-split for the engines."""

    url: str
    scheme: str
    host: str
    port: int
    base_path: str  # "" or "/prefix" without a trailing slash
    host_header: str  # value of the Host header sent upstream
    # Its position in the deployment's ``upstreams``: how client-facing errors name it (never by URL).
    index: int = 0
    # https:// only: the deployment's client TLS context (one per deployment, shared by every
    # client of its upstreams) and the name for SNI and the certificate check (None: ``host``).
    tls_context: ssl.SSLContext | None = None
    server_hostname: str | None = None
    # What the engines pool connections by: the URL, and for https:// also the deployment (its
    # TLS context): deployments with the same URL but other TLS settings never share a connection.
    pool_key: str = ""

    @property
    def display(self) -> str:
        """The URL without credentials (for operators' logs)."""
        u = URL(self.url)
        return str(u.with_user(None)) if u.user is not None or u.password is not None else self.url

    @classmethod
    def parse(
        cls,
        url: str,
        index: int = 0,
        tls_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        deployment: str = "",
    ) -> Upstream:
        """``tls_context``, ``server_hostname`` and ``deployment`` (whose context it is) apply to
        an https:// ``url`` only."""
        u = URL(url)
        assert u.host is not None and u.port is not None
        default_port = 443 if u.scheme == "https" else 80
        host_header = u.host if u.port == default_port else f"{u.host}:{u.port}"
        if ":" in u.host:
            host_header = f"[{u.host}]" if u.port == default_port else f"[{u.host}]:{u.port}"
        https = u.scheme == "https"
        return cls(
            url=url,
            scheme=u.scheme,
            host=u.host,
            port=u.port,
            base_path=u.raw_path.rstrip("/"),
            host_header=host_header,
            index=index,
            tls_context=tls_context if https else None,
            server_hostname=server_hostname if https else None,
            pool_key=f"{url} tls:{deployment}" if https else url,
        )


# No slots=True: compiled (deployments.pxd), it is an extension type with fixed fields.
@dataclass
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
    health_check: HealthCheckConfig | None
    balancer: Balancer[Upstream]
    # Per-request metric children (sidecar.metrics.Metrics.for_deployment).
    stats: DeploymentStats
    # Lower-case names of client headers dropped (never forwarded), for requests of a session
    # and for requests without one (see :func:`dropped_headers`).
    drop: frozenset[str] = field(default_factory=frozenset)
    drop_sessionless: frozenset[str] = field(default_factory=frozenset)
    # Whether the mode overrides on_response (the router skips the call otherwise).
    observes_responses: bool = False
    # Derived once for the request path.
    rewrites_body: bool = False  # the mode rewrites request bodies
    only_upstream: Upstream | None = None  # the upstream when there is exactly one
    # Limits and timeouts read per request: a plain field reads faster than a pydantic model's
    # (whose class hooks attribute reads), hundreds of instructions per read.
    max_body_bytes: int = field(init=False)
    max_parsed_body_bytes: int = field(init=False)
    max_json_depth: int = field(init=False)
    connect_timeout: float = field(init=False)
    first_byte_timeout: float = field(init=False)
    idle_timeout: float = field(init=False)

    def __post_init__(self) -> None:
        limits, timeouts = self.limits, self.timeouts
        self.max_body_bytes = limits.max_body_bytes
        self.max_parsed_body_bytes = limits.max_parsed_body_bytes
        self.max_json_depth = limits.max_json_depth
        self.connect_timeout = timeouts.connect
        self.first_byte_timeout = timeouts.first_byte
        self.idle_timeout = timeouts.idle

    @classmethod
    def from_config(
        cls,
        cfg: DeploymentConfig,
        *,
        selector_header: str = "",
        identity_headers: Iterable[str] = (),
        max_overrides: int = 100_000,
        stats: Callable[[str, str], DeploymentStats],
    ) -> Deployment:
        """Build the runtime deployment. ``selector_header`` and ``identity_headers`` (every
        header the identity reader consumes) feed the dropped-header sets; ``stats(name,
        mode_name)`` makes its metric children (:meth:`sidecar.metrics.Metrics.for_deployment`)."""
        mode = load_mode(cfg.mode).from_options(cfg.mode_options) if cfg.mode else None
        ctx = _tls_context(cfg)
        server_name = cfg.tls.server_name if cfg.tls is not None else None
        upstreams = tuple(Upstream.parse(u, i, ctx, server_name, cfg.name) for i, u in enumerate(cfg.upstreams))
        drop, drop_sessionless = dropped_headers(cfg, mode, selector_header, identity_headers)
        return cls(
            name=cfg.name,
            mode=mode,
            mode_name=cfg.mode or "none",
            upstreams=upstreams,
            trust_client_headers=cfg.trust_client_headers,
            strict=cfg.strict,
            reject_non_object_body=cfg.non_object_body == "reject",
            timeouts=cfg.timeouts,
            limits=cfg.limits,
            models=frozenset(cfg.models),
            health_check=cfg.health_check,
            balancer=Balancer(
                cfg.name, upstreams, failback=cfg.failback, health_check=cfg.health_check, max_overrides=max_overrides
            ),
            stats=stats(cfg.name, cfg.mode or "none"),
            drop=drop,
            drop_sessionless=drop_sessionless,
            observes_responses=mode is not None and type(mode).on_response is not Mode.on_response,
            rewrites_body=mode is not None and mode.mutates_body,
            only_upstream=upstreams[0] if len(upstreams) == 1 else None,
        )

    def pick_upstream(self, root: str | None) -> Upstream:
        """The upstream serving the tree ``root`` (see :mod:`sidecar.balancer`)."""
        return self.balancer.pick(root)


def _tls_context(cfg: DeploymentConfig) -> ssl.SSLContext | None:
    """The deployment's client TLS context, built once (None without https:// upstreams)."""
    if not any(u.startswith("https://") for u in cfg.upstreams):
        return None
    if cfg.tls is not None and not cfg.tls.verify:
        log.warning(
            "TLS verification is off: the upstreams' certificates are not checked", extra={"deployment": cfg.name}
        )
    return client_context(cfg.tls, cfg._path)


def dropped_headers(
    cfg: DeploymentConfig, mode: Mode | None, selector_header: str, identity_headers: Iterable[str]
) -> tuple[frozenset[str], frozenset[str]]:
    """The one place that decides which client headers never reach a deployment's upstream.

    Returns (for requests of a session, for requests without one), lower-case:
    - the deployment selector header, always (it is addressed to the sidecar);
    - the headers the mode emits, for session requests, unless the deployment trusts clients
      (the mode's own values replace them: no duplicates, no spoofing);
    - on strict deployments, every identity header (session, parent, root, final): the session
      was validated against the sessions API and only the mode's headers carry its id onward.
    """
    always = {selector_header.lower()} if selector_header else set()
    session = set(always)
    if mode is not None and not cfg.trust_client_headers:
        session.update(n.lower() for n in mode.emitted_headers())
    if cfg.strict:
        session.update(n.lower() for n in identity_headers)
    return frozenset(session), frozenset(always)
