"""Configuration: YAML file + environment + flags -> one frozen, validated :class:`Config`.

Precedence is flags > environment > file > defaults. Every error names the setting
(``mode_options.timeout_seconds: ...``) so the process can refuse to start with a useful message.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sidecar import headers as h
from sidecar.errors import ConfigError
from sidecar.validation import check_token, split_names, yaml_error_where, yaml_problem

ENV_PREFIX = "SIDECAR_"
# Flag / env name -> top-level config key. Env vars are SIDECAR_<NAME>.
SCALAR_KEYS = (
    "listen",
    "admin",
    "upstream",
    "mode",
    "engine",
    "log_level",
    "drain_grace_seconds",
    "shutdown_delay_seconds",
    "head_timeout_seconds",
    "admin_tokens_file",
    "admin_insecure",
    "idle_poll_us",
)
# Settings that were removed, with why: a configuration that still gives one is refused with this
# (file: the key; environment: SIDECAR_<KEY>), rather than as an unknown setting.
REMOVED = {
    "stream_batch_us": "it had no effect: streamed bodies are relayed by the engine's stream thread without batching",
}
# SIDECAR_* variables the sidecar reads outside the configuration (docs/reference.md).
OUTSIDE_CONFIG_ENV = (
    "SIDECAR_PURE_PYTHON",  # at install and at start: run the .py sources (sidecar/__init__.py, setup.py)
    "SIDECAR_REQUIRE_COMPILED",  # at install only (setup.py); accepted at start: an image or a shell may carry it
    "SIDECAR_STATE_PASSWORD",  # the shared store's password (sidecar.state.redis)
)
# Read only by this repository's scripts and tests, never by the sidecar: ignored, so that a
# developer's shell (or a test run) that exports them can still run `sidecar`. Nothing under
# sidecar/ reads them (tests/code/test_environment.py).
TOOLING_ENV = (
    "SIDECAR_TOOLS_DIR",
    "SIDECAR_TOOLS_PYTHON",
    "SIDECAR_GATEWAYS_DIR",
    "SIDECAR_GATEWAYS_PYTHON",
    "SIDECAR_IMAGE_PYTHON",
    "SIDECAR_UI_SCREENSHOT",
    "SIDECAR_AGENTS_DIR",
)


HeaderName = Annotated[str, BeforeValidator(lambda v: v.strip() if isinstance(v, str) else v)]
HeaderList = Annotated[list[HeaderName], BeforeValidator(split_names)]


class HostPort(BaseModel):
    """A listen address ``HOST:PORT`` (``[v6]:PORT`` for IPv6)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    host: str
    port: int = Field(ge=0, le=65535)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_host_port(value: Any) -> Any:
    """``"HOST:PORT"`` / ``"[v6]:PORT"`` -> fields; a mapping of ``host`` and ``port`` passes as is.
    Anything else (a bare port such as ``8080``, from YAML or the environment) is an error
    showing the expected form."""
    if isinstance(value, (dict, HostPort)):
        return value
    m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d+)|([^:\[\]]+):(\d+)", value.strip()) if isinstance(value, str) else None
    if not m:
        raise ValueError(f"must be HOST:PORT, e.g. {_example_address(value)}")
    host = m.group(1) or m.group(3)
    return {"host": host, "port": int(m.group(2) or m.group(4))}


def _example_address(value: Any) -> str:
    """An example address for an error message, with the user's port when they gave only one."""
    port = str(value).strip() if isinstance(value, (int, str)) and not isinstance(value, bool) else ""
    return f"0.0.0.0:{port}" if port.isdigit() and int(port) <= 65535 else "0.0.0.0:8080"


Address = Annotated[HostPort, BeforeValidator(parse_host_port)]


def check_url(value: str) -> str:
    from yarl import URL

    # The messages leave the value out: the error formatter appends it once.
    try:
        url = URL(value)
    except (ValueError, TypeError) as exc:
        raise ValueError("not a URL") from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError("must be an http:// or https:// URL with a host")
    if url.query_string or url.fragment:
        raise ValueError("must not carry a query or fragment")
    return str(url).rstrip("/")


UpstreamURL = Annotated[str, BeforeValidator(lambda v: check_url(v) if isinstance(v, str) else v)]


_M = TypeVar("_M", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


BODY_SIGNALS = ("prompt_cache_key", "user", "metadata.user_id", "conversation", "previous_response_id")


# The header families identity is read from (identity.clients); each one's headers are in
# docs/reference.md.
Client = Literal["generic", "claude_code", "codex"]
CLIENTS: tuple[Client, ...] = ("generic", "claude_code", "codex")
# The headers each client family reads itself: a generic tier naming one of them would shadow
# the family (its sub-agents would merge into one session, or lose their parent).
CLIENT_HEADERS = {
    "claude_code": (h.X_CLAUDE_CODE_SESSION_ID, h.X_CLAUDE_CODE_AGENT_ID, h.X_CLAUDE_CODE_PARENT_AGENT_ID),
    "codex": (h.CODEX_THREAD_ID, h.CODEX_SESSION_ID, h.X_CODEX_PARENT_THREAD_ID),
}


class IdentityConfig(_Strict):
    """Ordered signals of session identity; the first present one wins.

    Header signals come in families (``clients``), tried in order: the first family whose
    session signal a request carries gives its session, parent and root, all three from that
    family. ``generic`` is the ordered header lists below; ``claude_code`` and ``codex`` read
    those clients' own headers (a sub-agent is its own session, a child of the agent that spawned
    it). The final-turn flag is read for every family. Body signals (``body``, then
    ``fingerprint``) are read only when configured and only when no header named a session: they
    cost a parse of the request body.
    """

    clients: list[Client] = list(CLIENTS)
    # The generic family: AIPerf, opencode, generic clients.
    session: HeaderList = [h.X_CORRELATION_ID, h.X_SESSION_AFFINITY, h.X_SESSION_ID]
    parent: HeaderList = [h.X_PARENT_SESSION_ID, h.X_DYNAMO_PARENT_SESSION_ID]
    root: HeaderList = [h.X_ROOT_SESSION_ID]
    final: HeaderList = [h.X_SESSION_FINAL, h.X_DYNAMO_SESSION_FINAL]
    # OpenAI-compatible `prompt_cache_key` / `user`, Anthropic-style `metadata.user_id` (a JSON
    # object with `session_id`), the Responses API's `conversation` (a string or an object's
    # `id`) and `previous_response_id` (continues the session that produced that response; a
    # Responses request continuing none starts one), in the order given.
    body: list[Literal["prompt_cache_key", "user", "metadata.user_id", "conversation", "previous_response_id"]] = []
    # Last resort for clients that send nothing: a stable hash of the system prompt and the first
    # user message, the same for every turn of one conversation.
    fingerprint: bool = False

    @property
    def reads_body(self) -> bool:
        return bool(self.body) or self.fingerprint

    @field_validator("clients")
    @classmethod
    def _unique_clients(cls, v: list[str]) -> list[str]:
        twice = sorted({c for c in v if v.count(c) > 1})
        if twice:
            raise ValueError(f"names {twice[0]!r} twice")
        return v

    @field_validator("session", "parent", "root", "final")
    @classmethod
    def _tokens(cls, v: list[str], info: ValidationInfo) -> list[str]:
        for name in v:
            check_token(name)
        if h.X_REQUEST_ID.lower() in (n.lower() for n in v):
            raise ValueError("X-Request-ID is a per-request id and can never identify a session")
        owned = [n for n in v if n.lower() in h.PROXY_OWNED]
        if owned:
            raise ValueError(f"{owned[0]!r} frames or routes the message itself and cannot carry a session signal")
        # (validated after `clients`, which is declared first; only lists given are validated)
        clients = info.data.get("clients", CLIENTS)
        for name in v:
            for client in clients:
                if name.lower() in CLIENT_HEADERS.get(client, ()):
                    raise ValueError(
                        f"{name!r} is read by the {client} client family (identity.clients): remove it "
                        f"here, or remove {client} from identity.clients"
                    )
        if info.field_name != "final" and "generic" not in clients:
            raise ValueError("applies to the generic client family, which identity.clients leaves out")
        return v


class AffinityConfig(_Strict):
    """How the sidecar learns which worker served a turn (affinity proof)."""

    # Response headers naming the worker, first present wins (SMG answers x-smg-routed-worker-id).
    worker_headers: HeaderList = [h.X_SMG_ROUTED_WORKER_ID]

    @field_validator("worker_headers")
    @classmethod
    def _tokens(cls, v: list[str]) -> list[str]:
        for name in v:
            check_token(name)
        return v


class TimeoutsConfig(_Strict):
    """Upstream timeouts in seconds."""

    connect: float = Field(5.0, gt=0)
    # Time to the response head: long prompts on a loaded gateway legitimately take minutes.
    first_byte: float = Field(300.0, gt=0)
    # Longest silence between two body chunks in either direction.
    idle: float = Field(300.0, gt=0)


class LimitsConfig(_Strict):
    """Request limits."""

    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1)
    # Bodies the sidecar reads as JSON (body modes, body identity signals, routing by model) are
    # buffered and scanned whole: a lower bound than for bodies that only stream through. Unset,
    # it is 8 MiB or max_body_bytes, whichever is lower; set, it must not exceed max_body_bytes.
    max_parsed_body_bytes: int = Field(8 * 1024 * 1024, ge=1)
    # Nesting depth of those bodies; at most 255, what orjson serializes (a transform_body mode
    # gets the body as a dict that must serialize again).
    max_json_depth: int = Field(128, ge=1, le=255)
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    max_connections_per_upstream: int = Field(512, ge=1)

    @field_validator("max_parsed_body_bytes")
    @classmethod
    def _parsed_within_body(cls, v: int, info: ValidationInfo) -> int:
        body = info.data.get("max_body_bytes")
        if body is not None and v > body:
            raise ValueError(f"must not exceed max_body_bytes ({body})")
        return v

    @model_validator(mode="after")
    def _default_parsed_within_body(self) -> LimitsConfig:
        if "max_parsed_body_bytes" not in self.model_fields_set and self.max_parsed_body_bytes > self.max_body_bytes:
            # Unset, it follows a lower body limit (the model is frozen once validated).
            object.__setattr__(self, "max_parsed_body_bytes", self.max_body_bytes)
        return self


class HealthCheckConfig(_Strict):
    """Active health checks of a deployment's upstreams (``GET <upstream><path>``, 2xx = healthy)."""

    path: str = Field("/health", pattern=r"^/[^?#\s]*$")
    interval_seconds: float = Field(2.0, gt=0)
    timeout_seconds: float = Field(1.0, gt=0)
    # Consecutive failures that mark an upstream unhealthy, and successes that mark it healthy again.
    unhealthy_threshold: int = Field(1, ge=1)
    healthy_threshold: int = Field(1, ge=1)


class TlsConfig(_Strict):
    """Client TLS towards a deployment's ``https://`` upstreams (checked when the config loads:
    :func:`sidecar.tls.client_context`). Unset, upstreams are verified against the system CA
    bundle, and SNI and the certificate check use the URL's host."""

    # CA bundle (PEM) that verifies the upstream, instead of the system bundle.
    ca_file: str | None = None
    # Client certificate chain and its private key (PEM, unencrypted), for mutual TLS: both or neither.
    cert_file: str | None = None
    key_file: str | None = None
    # Name sent as SNI and required in the upstream's certificate, instead of the URL's host.
    server_name: str | None = Field(None, min_length=1, max_length=253, pattern=r"^[A-Za-z0-9._:-]+$")
    # false: accept any certificate (no chain or name check); logged at warning at start.
    verify: bool = True


class UsageConfig(_Strict):
    """Prompt-cache accounting of a deployment's responses (``sidecar.usage``)."""

    # Read the prompt-cache usage each response of a session reports and count it per session,
    # tree, turn and deployment. The response is relayed unchanged either way.
    accounting: bool = True
    # Ask for usage in streamed chat completions: add `stream_options.include_usage: true` to the
    # JSON body of every streamed `.../chat/completions` request of a session. It changes what the
    # client receives: one more chunk before `data: [DONE]`, with `choices: []` and the `usage`.
    include_usage: bool = False


class DeploymentConfig(_Strict):
    """One upstream deployment and how its requests are rewritten."""

    name: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    upstreams: Annotated[list[UpstreamURL], Field(min_length=1)]
    mode: str | None = None
    mode_options: dict[str, Any] = {}
    trust_client_headers: bool = False
    strict: bool = False
    models: list[str] = []
    # What a body-mutating mode does with a body that is not a JSON object.
    non_object_body: Literal["pass", "reject"] = "pass"
    timeouts: TimeoutsConfig = TimeoutsConfig()
    limits: LimitsConfig = LimitsConfig()
    # Client TLS of the https:// upstreams (given only when every upstream is https://).
    tls: TlsConfig | None = None
    # Several upstreams: each session tree goes to one (rendezvous hash of its root id); a tree
    # whose upstream is unhealthy fails over to the next-ranked healthy one.
    health_check: HealthCheckConfig | None = None
    # true: a failed-over tree returns to its first-ranked upstream once that one is healthy again.
    failback: bool = False
    usage: UsageConfig = UsageConfig()
    _path: str = PrivateAttr("")

    @model_validator(mode="after")
    def _options_need_mode(self) -> DeploymentConfig:
        if self.mode_options and not self.mode:
            raise ValueError("mode_options: given without a mode")
        return self


class ApiSessionsConfig(_Strict):
    """Bounds of the sessions created through the sessions API."""

    max_sessions: int = Field(10_000, ge=1)  # active API sessions; creating more answers 429
    # Idle TTL of a session created without `ttl_seconds`; null: such sessions never expire.
    default_ttl_seconds: float | None = Field(3600.0, gt=0)
    max_ttl_seconds: float = Field(7 * 86400.0, gt=0)
    # Closed and expired sessions are remembered (for 410 answers) up to this many, this long.
    tombstone_max: int = Field(10_000, ge=0)
    tombstone_ttl_seconds: float = Field(3600.0, ge=0)

    @model_validator(mode="after")
    def _default_within_max(self) -> ApiSessionsConfig:
        if self.default_ttl_seconds is not None and self.default_ttl_seconds > self.max_ttl_seconds:
            raise ValueError("default_ttl_seconds: must not exceed max_ttl_seconds")
        return self


class SessionsConfig(_Strict):
    """Bounds of the in-memory session tree and of the API-created sessions."""

    idle_ttl_seconds: float = Field(900.0, gt=0)
    max_live_sessions: int = Field(100_000, ge=1)
    # Session, parent and root ids longer than this (UTF-8 bytes) are kept and forwarded in a
    # stable fitted form (a prefix and a digest of the whole id): the cap bounds the memory one
    # session costs, whatever a client sends.
    max_id_bytes: int = Field(512, ge=64, le=65536)
    tombstone_max: int = Field(100_000, ge=0)
    tombstone_ttl_seconds: float = Field(600.0, ge=0)
    # Response ids remembered for `identity.body: [previous_response_id]` (which session produced
    # each), at most this many (the oldest forgotten first) and for at most this long.
    response_ids_max: int = Field(100_000, ge=1)
    response_ids_ttl_seconds: float = Field(3600.0, gt=0)
    api: ApiSessionsConfig = ApiSessionsConfig()


STATE_SCHEMES = ("memory", "redis", "rediss", "unix")


# The one option a store URL may carry in its query: the database (which a unix:// URL can give no
# other way). The sidecar sets every other connection option itself (timeouts from
# state.timeout_ms, no retries: the breaker serves on local state instead), and redis-py would let
# the URL's override them, or fail at the first connection on one it does not know.
_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?|[0-9A-Fa-f:.]+")


def check_state_url(value: str) -> str:
    """``state.url``: its scheme, host, port, database and query, so that a URL that passes here
    connects (or fails to reach its store) rather than failing in the client library at start.
    The messages leave the URL out (it may carry a password): the error formatter appends it,
    password masked."""
    from urllib.parse import parse_qsl

    from yarl import URL

    try:
        url = URL(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a URL ({exc})" if isinstance(exc, ValueError) else "not a URL") from None
    if url.scheme not in STATE_SCHEMES:
        raise ValueError(
            "must be memory://, redis://HOST:PORT[/DB], rediss://HOST:PORT[/DB] (TLS) or unix:///PATH/TO/SOCKET"
        )
    if url.fragment:
        raise ValueError("must not carry a fragment")
    query = parse_qsl(url.raw_query_string, keep_blank_values=True)
    for name, option in query:
        if name != "db":
            raise ValueError(
                f"query option {name!r} is not supported: the only one is db (the database number); "
                "timeouts come from state.timeout_ms"
            )
        if not option.isdigit():
            raise ValueError(f"query option 'db' must be a database number >= 0 (got {option!r})")
    if url.scheme in ("redis", "rediss"):
        if not url.host or not _HOSTNAME.fullmatch(url.host):
            raise ValueError("a redis:// or rediss:// URL needs a host name or an IP address")
        if url.path not in ("", "/") and not url.path[1:].isdigit():
            raise ValueError(f"the path is the database number, e.g. {url.scheme}://HOST:PORT/0 (got {url.path!r})")
        if url.path not in ("", "/") and query:
            raise ValueError("gives the database twice: in the path and as ?db=")
    elif url.scheme == "unix" and url.path in ("", "/"):
        raise ValueError("a unix:// URL needs the socket's path: unix:///PATH/TO/SOCKET")
    return value


def redact_url(value: str) -> str:
    """``value`` with the password of its user information masked (``redis://:***@host:6379``),
    for everything that shows a URL: printed configuration, errors, logs."""
    return _USERINFO.sub(lambda m: f"{m[1]}{m[2].split(':', 1)[0]}:***@" if ":" in m[2] else m[0], value, count=1)


# scheme://userinfo@ : greedy up to the last "@" before the path, as URL parsers split it.
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)@")


class StateConfig(_Strict):
    """Where session state lives beyond this process (sidecar.state)."""

    # memory:// keeps everything in this process (one replica); redis://, rediss:// (TLS) or
    # unix:// share sessions between replicas through Redis 7+ or Valkey and keep them across
    # restarts. A password may come in the URL, or from password_file / SIDECAR_STATE_PASSWORD.
    url: Annotated[str, AfterValidator(check_state_url)] = "memory://"
    # Isolates several fleets sharing one Redis.
    key_prefix: str = Field("sidecar:", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:{}-]+$")
    # true: refuse to start while the store cannot be used; false: start on local state, say so
    # (log, sidecar_state_store_up 0) and share once it is reachable.
    required: bool = False
    # Longest wait for the store on the request path; after a failure the store is skipped
    # (circuit breaker) until it answers again.
    timeout_ms: int = Field(250, ge=10, le=10_000)
    # Write-behind: session creation, in-flight changes, closes and mode state are written within
    # this interval (what a killed replica can lose), turn counts, activity and worker history
    # within 1 s.
    flush_interval_ms: int = Field(25, ge=5, le=1000)
    password_file: str | None = None
    # rediss://: the CA bundle the server's certificate is checked against (default: the system's).
    ca_file: str | None = None

    @property
    def shared(self) -> bool:
        return not self.url.startswith("memory:")


# Per-deployment settings that the top level carries only for the short form (`upstream:`).
_SHORT_FORM_ONLY = ("trust_client_headers", "non_object_body", "timeouts", "limits", "tls", "usage")


class Config(_Strict):
    """The whole, validated configuration. Build it with :func:`build_config`."""

    listen: Address = HostPort(host="127.0.0.1", port=8080)
    admin: Address = HostPort(host="127.0.0.1", port=9091)
    engine: Literal["aiohttp", "fast"] = "fast"
    # Fast engine, opt-in: keep polling this long after an I/O event instead of sleeping, while
    # events arrive closer together than this (sidecar.engine.idle_poll). 0 (default): never
    # poll; polling trades CPU for a tenth of a millisecond of latency at low concurrency.
    idle_poll_us: int = Field(0, ge=0, le=10_000)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    drain_grace_seconds: float = Field(25.0, ge=0)
    # On SIGTERM: /readyz answers 503 at once while the proxy keeps accepting and serving this
    # long (the endpoint removal reaches every load balancer meanwhile), then the drain begins.
    shutdown_delay_seconds: float = Field(5.0, ge=0)
    # A client's request head must arrive completely within this long (slow-header attacks hold a
    # connection and a parser buffer for as long as the head lasts): 408 and close. On the admin
    # listener, a connection without a whole head this long after opening or its last answer closes.
    head_timeout_seconds: float = Field(15.0, gt=0)
    # /readyz answers 200 only while every deployment has an upstream currently healthy (active
    # health checks, failed connections, a background connect probe), unless this is false.
    readiness_check_upstream: bool = True
    identity: IdentityConfig = IdentityConfig()
    affinity: AffinityConfig = AffinityConfig()
    sessions: SessionsConfig = SessionsConfig()
    # Request header naming the deployment explicitly; never forwarded upstream.
    deployment_header: HeaderName = h.X_SIDECAR_DEPLOYMENT
    # Deployment of requests that nothing else assigns; the first deployment when unset.
    default_deployment: str | None = None
    # YAML file of bearer tokens for the sessions API (`tokens: [{token, workspace} | {token, admin: true}]`).
    admin_tokens_file: str | None = None
    # Allow an unauthenticated sessions API on a non-loopback admin address.
    admin_insecure: bool = False
    # Session state beyond this process (memory:// by default); `--state URL` / SIDECAR_STATE set `state.url`.
    state: StateConfig = StateConfig()
    # Short form of a single deployment (the CLI flags); mutually exclusive with `deployments`.
    upstream: UpstreamURL | None = None
    mode: str | None = None
    mode_options: dict[str, Any] = {}
    trust_client_headers: bool = False
    non_object_body: Literal["pass", "reject"] = "pass"
    timeouts: TimeoutsConfig = TimeoutsConfig()
    limits: LimitsConfig = LimitsConfig()
    tls: TlsConfig | None = None
    usage: UsageConfig = UsageConfig()
    deployments: list[DeploymentConfig] = []

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v

    @field_validator("deployment_header")
    @classmethod
    def _header_token(cls, v: str) -> str:
        return check_token(v)

    @model_validator(mode="after")
    def _one_form(self) -> Config:
        short = self.upstream is not None
        if short and self.deployments:
            raise ValueError("upstream: give either `upstream` (one deployment) or `deployments`, not both")
        if not short and not self.deployments:
            raise ValueError("upstream: required (flag --upstream, env SIDECAR_UPSTREAM or `upstream:` in the file)")
        if not short and (self.mode or self.mode_options):
            raise ValueError("mode: with `deployments`, set each deployment's own `mode`")
        if not short:
            for name in _SHORT_FORM_ONLY:
                if name in self.model_fields_set:
                    raise ValueError(
                        f"{name}: with `deployments`, set it in each deployment (the top-level "
                        "setting describes the single `upstream` form only)"
                    )
        if self.mode_options and not self.mode:
            raise ValueError("mode_options: given without a mode")
        names = [d.name for d in self.deployments]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"deployments: duplicate names {sorted(dup)}")
        names = names or ["default"]
        if self.default_deployment is not None and self.default_deployment not in names:
            raise ValueError(
                f"default_deployment: names no deployment (got {self.default_deployment!r}; deployments are {names})"
            )
        served: dict[str, str] = {}
        for i, d in enumerate(self.deployments):
            for model in d.models:
                if model in served:
                    raise ValueError(
                        f"deployments[{i}].models: {model!r} is already served by deployment {served[model]!r}"
                    )
                served[model] = d.name
        if not self.admin.is_loopback and self.admin_tokens_file is None and not self.admin_insecure:
            raise ValueError(
                f"admin_insecure: the admin listener binds {self.admin}, not a loopback address, "
                "and no admin_tokens_file is set: the sessions API would be open to the network. "
                "Set admin_tokens_file, or admin_insecure: true to accept that"
            )
        return self

    def resolved_deployments(self) -> list[DeploymentConfig]:
        """Deployments in order; the short form becomes one deployment named ``default``."""
        if self.deployments:
            for i, d in enumerate(self.deployments):
                d._path = f"deployments[{i}]."
            return list(self.deployments)
        d = DeploymentConfig(
            name="default",
            upstreams=[self.upstream or ""],
            mode=self.mode,
            mode_options=self.mode_options,
            trust_client_headers=self.trust_client_headers,
            non_object_body=self.non_object_body,
            timeouts=self.timeouts,
            limits=self.limits,
            tls=self.tls,
            usage=self.usage,
        )
        return [d]

    def normalized(self) -> dict[str, Any]:
        """The effective configuration as plain data (what ``check-config`` prints)."""
        from sidecar.modes.registry import load_mode

        data = self.model_dump(
            mode="json",
            exclude={
                "upstream",
                "mode",
                "mode_options",
                "deployments",
                "trust_client_headers",
                "non_object_body",
                "timeouts",
                "limits",
                "tls",
                "usage",
            },
        )
        deps = []
        for d in self.resolved_deployments():
            dd = d.model_dump(mode="json")
            if d.mode:
                dd["mode_options"] = load_mode(d.mode).Options.model_validate(d.mode_options).model_dump(mode="json")
            deps.append(dd)
        data["listen"] = str(self.listen)
        data["admin"] = str(self.admin)
        data["state"]["url"] = redact_url(self.state.url)
        for dd in deps:
            dd["upstreams"] = [redact_url(u) for u in dd["upstreams"]]
        data["deployments"] = deps
        return data


def _fmt_loc(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line per error: ``path: message (got value)``."""
    lines = []
    for err in exc.errors():
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        path = prefix + _fmt_loc(loc)
        msg = err["msg"].removeprefix("Value error, ")
        got = err.get("input")
        # The value once: some messages (a mode's own checks, header-name checks) already quote it.
        quoted = "(got " in msg or (isinstance(got, str) and repr(got) in msg)
        got_s = (
            ""
            if err["type"] in ("missing", "extra_forbidden") or isinstance(got, dict) or quoted
            else f" (got {redact_url(got)!r})"
            if isinstance(got, str)
            else f" (got {got!r})"
        )
        if err["type"] == "extra_forbidden":
            msg = "unknown setting"
        # Whole-model checks carry no location: their messages start with the setting name.
        lines.append(f"{path}: {msg}{got_s}" if path else msg)
    return "\n".join(lines)


def parse_kv_list(items: Sequence[str], what: str) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``; ``what`` names the setting in errors."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{what}: expected key=value (got {item!r})")
        out[key.strip()] = value.strip()
    return out


def _env_layer(env: Mapping[str, str]) -> dict[str, Any]:
    layer: dict[str, Any] = {}
    for key in SCALAR_KEYS:
        val = env.get(ENV_PREFIX + key.upper())
        if val is not None and val != "":
            layer[key] = val
    state = env.get(ENV_PREFIX + "STATE")
    if state:
        layer["state"] = {"url": state}
    opts = env.get(ENV_PREFIX + "MODE_OPTS")
    if opts:
        # Commas also separate identity_headers names, so split only before `key=`.
        items = re.split(r",(?=\s*[A-Za-z_][A-Za-z0-9_]*\s*=)", opts)
        layer["mode_options"] = parse_kv_list(items, ENV_PREFIX + "MODE_OPTS")
    return layer


def config_env_names() -> tuple[str, ...]:
    """Every environment variable that sets a configuration setting."""
    return (
        *(ENV_PREFIX + k.upper() for k in SCALAR_KEYS),
        ENV_PREFIX + "STATE",
        ENV_PREFIX + "MODE_OPTS",
        ENV_PREFIX + "CONFIG",
    )


# Kubernetes gives every container <SERVICE>_SERVICE_HOST, <SERVICE>_PORT=tcp://..., ... for each
# Service of its namespace (enableServiceLinks, on by default), so a Service named `sidecar-...`
# (a Helm release named `sidecar`) puts SIDECAR_* names in the environment: never refused.
_SERVICE_LINK = re.compile(
    r"SIDECAR(?:_[A-Z0-9_]+?)?_(SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?|PORT|PORT_\d+_(?:TCP|UDP|SCTP)(?:_PROTO|_PORT|_ADDR)?)"
)


def _service_link(name: str, value: str) -> bool:
    """A variable Kubernetes sets for a Service: its name and its value both have the form."""
    m = _SERVICE_LINK.fullmatch(name)
    if m is None:
        return False
    kind = m.group(1)
    if kind == "SERVICE_HOST" or kind.endswith("_ADDR"):
        try:
            ipaddress.ip_address(value)
        except ValueError:
            return False
        return True
    if kind.startswith("SERVICE_PORT") or (kind.startswith("PORT_") and kind.endswith("_PORT")):
        return value.isdigit()
    if kind.endswith("_PROTO"):
        return value in ("tcp", "udp", "sctp")
    return re.fullmatch(r"(?:tcp|udp|sctp)://\S+", value) is not None  # PORT, PORT_<n>_<proto>


def _setting_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of every setting of ``model``, nested models walked (``sessions.api.max_sessions``)."""
    import typing

    paths = []
    for name, field in model.model_fields.items():
        paths.append(prefix + name)
        if typing.get_origin(field.annotation) is list:
            continue  # deployments[]: a variable could not name one
        for tp in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(tp, type) and issubclass(tp, BaseModel) and tp is not HostPort:
                paths.extend(_setting_paths(tp, f"{prefix}{name}."))
                break
    return paths


def unknown_env_problems(env: Mapping[str, str]) -> list[str]:
    """One line per SIDECAR_* variable the sidecar does not know, naming the nearest valid name:
    a typo must not be ignored while the setting it meant silently keeps its default."""
    import difflib

    known = set(config_env_names()) | set(OUTSIDE_CONFIG_ENV) | set(TOOLING_ENV)
    # Settings under the name a variable of theirs would have: the two whose variable is named
    # otherwise, and those without one (set in the file only).
    aliases = {ENV_PREFIX + "STATE_URL": ENV_PREFIX + "STATE", ENV_PREFIX + "MODE_OPTIONS": ENV_PREFIX + "MODE_OPTS"}
    file_only = {
        ENV_PREFIX + path.replace(".", "_").upper(): path
        for path in _setting_paths(Config)
        if ENV_PREFIX + path.replace(".", "_").upper() not in known | aliases.keys()
    }
    # Compared without the common prefix, which would make every name look alike.
    candidates = {n.removeprefix(ENV_PREFIX): n for n in [*sorted(known - set(TOOLING_ENV)), *file_only]}
    problems = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in known or _service_link(name, env[name]):
            continue
        removed = name.removeprefix(ENV_PREFIX).lower()
        if removed in REMOVED:
            problems.append(f"{name}: {removed} was removed ({REMOVED[removed]}): delete the variable")
            continue
        if name in file_only or name in aliases:
            meant: str | None = aliases.get(name, name)
        else:
            near = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), candidates, 1, 0.7)
            meant = candidates[near[0]] if near else None
        if meant is None:
            hint = ""
        elif meant in file_only:
            setting = file_only[meant] if meant == name else f"did you mean the setting {file_only[meant]}? It"
            hint = f"; {setting} has no variable: set it in the configuration file (--config / SIDECAR_CONFIG)"
        else:
            hint = f"; did you mean {meant}?"
        problems.append(f"{name}: unknown environment variable{hint}")
    return problems


def _overlay(base: dict[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    if "mode" in layer and layer["mode"] != base.get("mode"):
        # Options of a mode that a higher layer replaced do not apply to the new one.
        out.pop("mode_options", None)
    for key, value in layer.items():
        if key == "mode_options":
            out["mode_options"] = {**(out.get("mode_options") or {}), **value}
        elif key == "state" and isinstance(out.get("state"), dict):
            out["state"] = {**out["state"], **value}  # the URL replaces the file's, its other keys stay
        else:
            out[key] = value
    return out


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a mapping."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}{yaml_error_where(exc)}: invalid YAML: {yaml_problem(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    return data


def build_config(
    *,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file: str | Path | None = None,
) -> Config:
    """Merge defaults < file < env < flags and validate, including every mode's options.

    ``flags`` keys are the config keys (``listen``, ``upstream``, ``mode``, ...), with
    ``mode_opt`` a list of ``key=value`` strings. ``env`` defaults to ``os.environ``; its
    ``SIDECAR_CONFIG`` names the file when ``file`` is not given.
    """
    env = os.environ if env is None else env
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    file = file or flags.pop("config", None) or env.get(ENV_PREFIX + "CONFIG") or None
    flags.pop("config", None)
    data: dict[str, Any] = load_file(file) if file else {}
    data = _overlay(data, _env_layer(env))
    flag_layer = dict(flags)
    if "state" in flag_layer:
        flag_layer["state"] = {"url": flag_layer["state"]}
    if "mode_opt" in flag_layer:
        flag_layer["mode_options"] = parse_kv_list(flag_layer.pop("mode_opt") or [], "--mode-opt")
    data = _overlay(data, flag_layer)
    # Every problem at once: the settings, then what is checked on the merged data even where
    # other settings are invalid (each mode's options, TLS and store files, the tokens file).
    problems = unknown_env_problems(env)
    for key in REMOVED.keys() & data.keys():
        problems.append(f"{key}: removed ({REMOVED[key]}): delete it from the configuration")
        del data[key]
    cfg: Config | None = None
    try:
        cfg = Config.model_validate(data)
    except ValidationError as exc:
        problems.append(format_validation_error(exc))
    problems += _mode_problems(data)
    problems += _tls_problems(cfg.resolved_deployments() if cfg is not None else _raw_deployments(data))
    state = cfg.state if cfg is not None else _valid_or_none(StateConfig, data.get("state") or {})
    if state is not None:
        problems += _state_problems(state)
    tokens_file = data.get("admin_tokens_file")
    if isinstance(tokens_file, str):
        from sidecar.auth import load_tokens

        try:
            load_tokens(tokens_file)  # refuse a bad tokens file now, naming the problem
        except ConfigError as exc:
            problems.append(str(exc))
    if problems or cfg is None:
        raise ConfigError("\n".join(problems))
    return cfg


def _valid_or_none(model: type[_M], raw: Any) -> _M | None:
    try:
        return model.model_validate(raw)
    except ValidationError:
        return None  # reported with the whole configuration


def _raw_deployments(data: Mapping[str, Any]) -> list[DeploymentConfig]:
    """The deployments that are valid on their own, when the configuration as a whole is not."""
    deps = data.get("deployments")
    if not deps:
        one = _valid_or_none(DeploymentConfig, {"upstreams": [data.get("upstream")], "tls": data.get("tls")})
        return [one] if one is not None else []
    found = []
    for i, raw in enumerate(deps if isinstance(deps, list) else []):
        d = _valid_or_none(DeploymentConfig, raw)
        if d is not None:
            d._path = f"deployments[{i}]."
            found.append(d)
    return found


def _tls_problems(deployments: Sequence[DeploymentConfig]) -> list[str]:
    """``tls`` only with https:// upstreams; its files readable and consistent (the context is
    built once here to prove it, and again when the deployment starts)."""
    from sidecar.tls import client_context

    problems: list[str] = []
    for d in deployments:
        if d.tls is None:
            continue
        plain = [i for i, url in enumerate(d.upstreams) if not url.startswith("https://")]
        if plain:
            where = f"{d._path}upstreams[{plain[0]}]" if d._path else "upstream"
            problems.append(f"{d._path}tls: applies to https:// upstreams only; {where} is http://")
            continue
        try:
            client_context(d.tls, d._path)
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def _state_problems(state: StateConfig) -> list[str]:
    """The shared store's files are readable now and apply to its URL: a missing one would
    otherwise fail at the first connection, naming neither the setting nor the file."""
    from sidecar.tls import check_ca_file, readable

    scheme = state.url.split(":", 1)[0]
    problems: list[str] = []
    if state.password_file is not None:
        if not state.shared:
            problems.append("state.password_file: applies to a shared store only; state.url is memory://")
        else:
            try:
                readable(state.password_file, "state.password_file")
            except ConfigError as exc:
                problems.append(str(exc))
    if state.ca_file is not None:
        if scheme != "rediss":
            problems.append(f"state.ca_file: applies to rediss:// URLs only; state.url is {scheme}://")
        else:
            try:
                check_ca_file(state.ca_file, "state.ca_file")
            except ConfigError as exc:
                problems.append(str(exc))
    return problems


def _mode_problems(data: Mapping[str, Any]) -> list[str]:
    """Each deployment's mode and its options, read from the merged settings so that they are
    checked even where other settings are invalid (malformed entries are the model's to report)."""
    from sidecar.modes.base import ModeContractError
    from sidecar.modes.registry import UnknownMode, load_mode

    deps = data.get("deployments")
    entries = [("", data), *((f"deployments[{i}].", d) for i, d in enumerate(deps if isinstance(deps, list) else []))]
    problems: list[str] = []
    for path, d in entries:
        if not isinstance(d, Mapping):
            continue
        mode, options = d.get("mode"), d.get("mode_options") or {}
        if not mode or not isinstance(mode, str) or not isinstance(options, dict):
            continue
        try:
            mode_cls = load_mode(mode)
        except (UnknownMode, ModeContractError) as exc:
            problems.append(f"{path}mode: {exc}")
            continue
        try:
            mode_cls.Options.model_validate(options)
        except ValidationError as exc:
            problems.append(format_validation_error(exc, prefix=f"{path}mode_options."))
        except ValueError as exc:
            problems.append(f"{path}mode_options: {exc}")
    return problems
