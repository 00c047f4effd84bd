"""Bearer tokens of the sessions API, loaded from a YAML file (config ``admin_tokens_file``).

File format::

    tokens:
      - {token: "s3cret-a", workspace: ws-a}   # sees and closes only ws-a's sessions
      - {token: "s3cret-admin", admin: true}   # sees every session

Tokens are compared with :func:`hmac.compare_digest` against every configured token (no early
exit) and never logged or echoed. A token shorter than 16 characters, or one that reads like the
placeholder of an example (:data:`PLACEHOLDER`), refuses the whole file: the error names the entry.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sidecar.errors import ConfigError
from sidecar.validation import yaml_error_where

WORKSPACE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
MIN_TOKEN_CHARS = 16
# Tokens copied from an example instead of generated. The Helm chart refuses the same pattern
# (templates/_helpers.tpl, session-sidecar.checkTokens); a test keeps the two identical.
PLACEHOLDER = re.compile(r"(?i)change[-_ ]?me|replace|placeholder|example|^<.*>$")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a workspace's token, an admin token, or anyone (no tokens configured)."""

    workspace: str | None
    admin: bool

    def sees(self, workspace: str | None) -> bool:
        """Whether this caller may see a session owned by ``workspace`` (None: no workspace)."""
        return self.admin or (self.workspace is not None and workspace == self.workspace)


OPEN = Principal(workspace=None, admin=True)


@dataclass(frozen=True, slots=True)
class _Token:
    secret: bytes
    principal: Principal


class TokenSet:
    """The configured tokens; :meth:`authenticate` maps an ``Authorization`` value to a caller."""

    def __init__(self, tokens: list[_Token]) -> None:
        self._tokens = tuple(tokens)

    def __repr__(self) -> str:
        return f"TokenSet({len(self._tokens)} tokens)"

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The caller of a request with this ``Authorization`` header; None when not authorized."""
        if not authorization:
            return None
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            return None
        given = value.strip().encode("utf-8", "surrogateescape")
        found: Principal | None = None
        for tok in self._tokens:  # compare with all of them: timing does not reveal which matched
            if hmac.compare_digest(given, tok.secret) and found is None:
                found = tok.principal
        return found


def load_tokens(path: str | Path) -> TokenSet:
    """Read and validate a tokens file; :class:`ConfigError` names the bad entry (never a token)."""
    where = f"admin_tokens_file ({path})"
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:  # position only: PyYAML's excerpt of the line could show a token
        raise ConfigError(f"{where}{yaml_error_where(exc)}: invalid YAML") from None
    if not isinstance(data, dict) or not isinstance(data.get("tokens"), list) or set(data) != {"tokens"}:
        raise ConfigError(f"{where}: must be a mapping with one key, `tokens`, holding a list")
    tokens: list[_Token] = []
    seen: set[bytes] = set()
    for i, entry in enumerate(data["tokens"]):
        tokens.append(_parse_entry(entry, f"{where}: tokens[{i}]", seen))
    if not tokens:
        raise ConfigError(f"{where}: tokens: at least one token is required")
    return TokenSet(tokens)


def _parse_entry(entry: Any, where: str, seen: set[bytes]) -> _Token:
    if not isinstance(entry, dict) or not set(entry) <= {"token", "workspace", "admin"}:
        raise ConfigError(f"{where}: must be a mapping of token, workspace and/or admin")
    secret = entry.get("token")
    if not isinstance(secret, str) or len(secret) < MIN_TOKEN_CHARS or re.search(r"\s", secret):
        raise ConfigError(
            f"{where}.token: must be a string of at least {MIN_TOKEN_CHARS} characters without "
            "spaces (generate one with `openssl rand -hex 32`)"
        )
    if PLACEHOLDER.search(secret):
        raise ConfigError(
            f"{where}.token: is a placeholder (it says change-me, replace, placeholder or "
            "example, or is written <...>): replace it with a random token "
            "(`openssl rand -hex 32`)"
        )
    raw = secret.encode()
    if raw in seen:
        raise ConfigError(f"{where}.token: duplicate token")
    seen.add(raw)
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise ConfigError(f"{where}.admin: must be true or false")
    workspace = entry.get("workspace")
    if workspace is not None and (not isinstance(workspace, str) or not re.match(WORKSPACE_PATTERN, workspace)):
        raise ConfigError(f"{where}.workspace: must match {WORKSPACE_PATTERN}")
    if workspace is None and not admin:
        raise ConfigError(f"{where}: needs a workspace or admin: true")
    return _Token(raw, Principal(workspace=workspace, admin=admin))
