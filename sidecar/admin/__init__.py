"""The admin listener: health, readiness, metrics and the sessions API (never on the proxy port).
:func:`sidecar.admin.server.build_admin_app` builds it."""
