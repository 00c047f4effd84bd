"""Property-based conformance of the admin listener to its own /openapi.json (schemathesis).

The sidecar runs on its own event loop in a thread (schemathesis calls are synchronous);
a few examples per operation keep this to a few seconds.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from prometheus_client import CollectorRegistry

from sidecar.app import Sidecar
from tests.sessions.support import TOKEN_ADMIN, bearer, deployment, make_config, tokens_file


class ThreadedSidecar:
    """A sidecar serving on loopback from a background thread until :meth:`stop`."""

    def __init__(self, **file_keys: object) -> None:
        self.config = make_config("aiohttp", **file_keys)
        self.admin_url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        sc = Sidecar(self.config, registry=CollectorRegistry())
        await sc.start()
        self.admin_url = sc.admin_url
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await sc.stop()

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(10), "sidecar did not start"

    def stop(self) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture(params=["open", "tokens"])
def admin(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, str]]]:
    keys: dict[str, object] = {
        "deployments": [
            deployment("chat", "http://127.0.0.1:9"),
            deployment("agents", "http://127.0.0.1:9", strict=True),
        ],
        "readiness_check_upstream": False,
        "drain_grace_seconds": 1,
    }
    headers: dict[str, str] = {}
    if request.param == "tokens":
        keys["admin_tokens_file"] = tokens_file()
        headers = bearer(TOKEN_ADMIN)
    sc = ThreadedSidecar(**keys)
    sc.start()
    yield sc.admin_url, headers
    sc.stop()


@pytest.mark.timeout(60)
def test_admin_api_conforms_to_its_openapi_document(admin):
    base, headers = admin
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "POST /v1/sessions",
        "GET /v1/sessions",
        "GET /v1/sessions/{session_id}",
        "POST /v1/sessions/{session_id}/close",
        "GET /v1/trees/{root}",
    }, [op.label for op in operations]
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=12, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
        )
        def conforms(case: schemathesis.Case) -> None:
            case.call_and_validate(base_url=base, headers=headers)

        conforms()
