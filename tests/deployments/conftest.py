"""Fixtures of the deployments tests: the same as the sessions tests' (see tests/sessions/support.py)."""

from tests.sessions.conftest import http, launch, launch_api  # noqa: F401
