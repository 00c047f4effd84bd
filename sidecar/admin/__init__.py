"""The admin listener: health, readiness, metrics and the sessions API (never on the proxy port)."""

from sidecar.admin.server import build_admin_app

__all__ = ["build_admin_app"]
