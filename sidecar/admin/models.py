"""The admin listener's wire shapes as pydantic models: the request body of the sessions API
and every JSON answer of ``/v1/*``, ``/healthz`` and ``/readyz``.

:mod:`sidecar.admin.openapi` builds the schemas of ``/openapi.json`` from these models, so class
docstrings and field descriptions are what API users read. The handlers build their answers as
plain dicts (serialized with orjson); these models describe them field for field: a field
without a default is always present, one made with :func:`_absent_unless` is present only in
the answers its description names, and no other field may appear (the tests validate real
answers of every endpoint against the served document). Times are RFC 3339 strings.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from sidecar.lineage import EndReason
from sidecar.sessions import SessionStatus

__all__ = [
    "DOCUMENTED",
    "SESSION_ID_PATTERN",
    "Affinity",
    "DeploymentReadiness",
    "Error",
    "ErrorDetail",
    "PromptCache",
    "Readiness",
    "Session",
    "SessionCreate",
    "SessionList",
    "Status",
    "TreeNode",
    "UpstreamReadiness",
    "WorkerRun",
    "WorkerRuns",
]

SESSION_ID_PATTERN = r"^[A-Za-z0-9._:@+=~-]{1,256}$"


def _drop_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


def _absent_unless(description: str, **constraints: Any) -> Any:
    """A field that some answers leave out (never null): not required, and no default in the
    document (the None default only lets a model validate an answer without it)."""
    return Field(None, description=description, json_schema_extra=_drop_default, **constraints)


class _Answer(BaseModel):
    # exactly the fields declared: an answer with another field does not validate
    model_config = ConfigDict(extra="forbid")


# -- request ---------------------------------------------------------------------------------


class SessionCreate(BaseModel):
    """The body of `POST /v1/sessions`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    deployment: str = Field(min_length=1, max_length=63, description="the deployment to bind the session to")
    session_id: str | None = Field(
        None,
        pattern=SESSION_ID_PATTERN,
        description="default: a generated UUID. A workspace token chooses ids in its own namespace only: "
        "`<workspace>:` and at least one more character (any other id is refused with 400 "
        "`invalid_request`, whether or not it exists); admin tokens and an open API choose any id",
    )
    ttl_seconds: float | None = Field(None, gt=0, description="expire after this long without a request")
    parent: str | None = Field(
        None, pattern=SESSION_ID_PATTERN, description="an active session of the same deployment you created"
    )


# -- sessions and trees ----------------------------------------------------------------------


class WorkerRun(_Answer):
    """Consecutive turns of a session on one upstream worker."""

    worker: str
    turns: int = Field(ge=1)


class WorkerRuns(RootModel[list[WorkerRun]]):
    """which upstream worker served the session's turns, as runs of consecutive turns on one worker,
    oldest first (the last 8 runs)"""


class Affinity(_Answer):
    """turns by worker outcome: first, same_worker (as the previous turn), moved"""

    first: int = Field(ge=0)
    same_worker: int = Field(ge=0)
    moved: int = Field(ge=0)


class PromptCache(_Answer):
    """prompt-cache accounting: what the upstream's responses reported of their prompt tokens and
    of those it found in its prefix cache (Anthropic: `input_tokens + cache_read_input_tokens +
    cache_creation_input_tokens` and `cache_read_input_tokens`), summed over the turns whose
    response reported both; a response that did not is counted in `unknown_turns`, never as
    zero. Shared across replicas with a shared store (written behind, within a second)"""

    prompt_tokens: int = Field(ge=0)
    cached_tokens: int = Field(ge=0)
    cached_ratio: float | None = Field(ge=0, le=1, description="cached_tokens / prompt_tokens; null before any")
    reported_turns: int = Field(ge=0, description="turns whose response reported prompt and cached tokens")
    unknown_turns: int = Field(
        ge=0,
        description="turns answered 200 whose response reported no usable usage (none, no cached count, "
        "malformed, or a body the sidecar could not read)",
    )


class Session(_Answer):
    """A session: created through this API (`origin: api`) or learned from request headers
    (`origin: traffic`)."""

    id: str
    deployment: str
    workspace: str | None = Field(
        description="the workspace whose token created it; null when an admin token or "
        "an open API created it, and for traffic sessions"
    )
    status: SessionStatus
    origin: Literal["api", "traffic"] = Field(
        description="created through this API, or learned from request headers (visible to admin tokens only)"
    )
    parent: str | None
    ttl_seconds: float | None = Field(description="expiry after this long without a request; null: none")
    created_at: datetime
    last_active_at: datetime | None
    expires_at: datetime | None
    ended_at: datetime | None
    root: str = Field(
        description="root of its lineage tree: itself, or for a session created with a `parent`, the "
        "parent's root from creation"
    )
    turns: int = Field(ge=0)
    in_flight: int = Field(ge=0)
    final_turn_seen: bool
    placeholder: bool = Field(
        description="named by another session (as its parent or root) but had no request of its own; "
        "always false for API sessions"
    )
    end_reason: EndReason | None = Field(
        description="why it ended; null while it has not (a closed session whose requests still run has not)"
    )
    workers: WorkerRuns
    affinity: Affinity
    prompt_cache: PromptCache


class SessionList(_Answer):
    """One page of sessions, in creation order."""

    data: list[Session]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null on the last")


class TreeNode(_Answer):
    """A session of a lineage tree, with the sessions below it: learned from traffic or created
    through this API (with or without a request of its own), the same fields either way."""

    session: str
    parent: str | None = Field(
        description="null for the root, and for a session that joined the tree through a "
        "root hint without naming a parent"
    )
    root: str
    deployment: str | None = Field(
        description="null only for a placeholder nothing is held of any more: a root whose record the "
        "shared session store no longer holds, or an API session forgotten after it ended"
    )
    created_at: datetime | None = Field(description="null only when `deployment` is")
    last_active_at: datetime | None = Field(description="null only when `deployment` is")
    turns: int = Field(ge=0)
    in_flight: int = Field(ge=0)
    final_turn_seen: bool
    ended: bool
    end_reason: EndReason | None = Field(description="why it ended; null while it has not")
    closed: bool = Field(description="closed through the API or ended: admits no new request")
    placeholder: bool = Field(
        description="named by another session (as its parent or root) but had no request of its own"
    )
    workers: WorkerRuns
    affinity: Affinity
    prompt_cache: PromptCache
    subtree_prompt_cache: PromptCache = Field(
        description="this session's `prompt_cache` summed with every session's below it: on the root, the "
        "tree's (memory store: every session the tree holds, those the view cut included; shared store: the "
        "sessions the view read, ended ones whose record is still kept included)"
    )
    children: list[TreeNode] = Field(description="oldest first; cut by the view's bounds (see `omitted`)")
    omitted: int = _absent_unless("present when the view cut sessions below this node: how many are not shown", ge=0)
    truncated: bool = _absent_unless(
        "shared session store only; present (true) when this node has more children than a view reads "
        "(1,000): the children shown are chosen among those read"
    )


# -- errors, health, readiness ---------------------------------------------------------------


class ErrorDetail(BaseModel):
    """What went wrong; some types carry more fields (for example `deployments`, `session_id`)."""

    model_config = ConfigDict(extra="allow")
    type: str = Field(description="stable machine-readable type")
    message: str


class Error(_Answer):
    """An error answer."""

    error: ErrorDetail


class Status(_Answer):
    """Liveness."""

    status: Literal["ok"]


class UpstreamReadiness(_Answer):
    """One upstream of a deployment, by its index in the deployment's `upstreams` (never its URL)."""

    index: int = Field(ge=0)
    healthy: bool
    checked_by: Literal["health_check", "connect"] = Field(
        description="an active health check, or connections (passive)"
    )
    reason: str
    since: datetime = Field(description="when `healthy` last changed")


class DeploymentReadiness(_Answer):
    """A deployment: ready while one of its upstreams is healthy."""

    name: str
    ready: bool
    upstreams: list[UpstreamReadiness]


class Readiness(_Answer):
    """Readiness, and why."""

    status: Literal["ready", "waiting_for_upstream", "draining"]
    reason: str = _absent_unless("why it is not ready: draining, or the deployments without a healthy upstream")
    deployments: list[DeploymentReadiness] = _absent_unless(
        "each deployment's upstreams, when readiness checks upstreams (`readiness_check_upstream`)"
    )


# The request body and every answer the document describes: its schemas are generated from
# these and the models they refer to.
DOCUMENTED: tuple[type[BaseModel], ...] = (SessionCreate, Session, SessionList, TreeNode, Error, Status, Readiness)
