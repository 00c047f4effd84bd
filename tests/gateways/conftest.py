"""Fixtures for the real-gateway tests (``pytest -m gateway``).

Gateways come from ``scripts/install_gateways.sh`` (found via ``SIDECAR_GATEWAYS_DIR``). When one
is missing the tests that need it fail if ``CI`` is set and are skipped otherwise. Every process
is started on a free 127.0.0.1 port per test module and stopped by PID when the module ends.
Control runs (traffic sent straight to a gateway, without the sidecar) are reported, not
asserted, in a "gateway reports" section of the terminal summary.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from .procs import (
    MockWorker,
    Sidecar,
    Stack,
    gateway_missing,
    start_dynamo,
    start_mock_workers,
    start_sidecar,
    start_smg,
    start_vllm_router,
    stop_all,
)

_REPORTS = pytest.StashKey[list[str]]()


def require_gateway(name: str) -> None:
    """Fail (under CI) or skip (locally, naming the install command) when ``name`` is missing."""
    why = gateway_missing(name)
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="module")
def gateway_logs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """A per-module directory for the processes' logs and state."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])


@pytest.fixture(scope="module")
def mock_workers(gateway_logs: Path) -> Iterator[list[MockWorker]]:
    """Two mock OpenAI-compatible workers, ``w1`` and ``w2``."""
    workers = start_mock_workers(["w1", "w2"], gateway_logs)
    yield workers
    stop_all(w.proc for w in workers)


@pytest.fixture
def fresh_workers(mock_workers: list[MockWorker]) -> list[MockWorker]:
    """The module's mock workers with their received-request records cleared."""
    for w in mock_workers:
        w.clear_received()
    return mock_workers


@pytest.fixture(scope="module")
def smg(request: pytest.FixtureRequest, gateway_logs: Path) -> Iterator[Stack]:
    """SMG 1.13 ``--policy manual`` in front of the two mock workers."""
    require_gateway("smg")
    mock_workers: list[MockWorker] = request.getfixturevalue("mock_workers")
    stack = start_smg([w.url for w in mock_workers], gateway_logs, policy="manual")
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def vllm_router(request: pytest.FixtureRequest, gateway_logs: Path) -> Iterator[Stack]:
    """vllm-router 0.1.17 ``--policy sticky_least_loaded`` in front of the two mock workers."""
    require_gateway("vllm-router")
    mock_workers: list[MockWorker] = request.getfixturevalue("mock_workers")
    stack = start_vllm_router([w.url for w in mock_workers], gateway_logs, policy="sticky_least_loaded")
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def dynamo(gateway_logs: Path) -> Iterator[Stack]:
    """Dynamo 1.6.1 frontend (KV router, session affinity TTL 60 s) + two mocker workers."""
    require_gateway("dynamo")
    stack = start_dynamo(gateway_logs, gateway_logs / "dynamo-state", workers=2)
    yield stack
    stack.stop()


SidecarFactory = Callable[..., Sidecar]


@pytest.fixture(scope="module")
def sidecar_factory(gateway_logs: Path) -> Iterator[SidecarFactory]:
    """``factory(upstream, mode, **mode_opts)``: a running sidecar subprocess, stopped when the
    module ends."""
    started: list[Sidecar] = []

    def factory(upstream: str, mode: str, mode_opts: Mapping[str, str] | None = None) -> Sidecar:
        sidecar = start_sidecar(upstream, mode, gateway_logs, mode_opts=mode_opts)
        started.append(sidecar)
        return sidecar

    yield factory
    stop_all(s.proc for s in started)


@pytest.fixture
def gateway_report(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """``report(line)``: add a line to the "gateway reports" terminal summary section."""
    lines = request.config.stash.setdefault(_REPORTS, [])

    def report(line: str) -> None:
        lines.append(f"{request.node.nodeid}: {line}")

    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    lines = config.stash.get(_REPORTS, [])
    if lines:
        terminalreporter.section("gateway reports")
        for line in lines:
            terminalreporter.write_line(line)
