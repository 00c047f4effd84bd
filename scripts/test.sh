#!/usr/bin/env bash
# Installs what the tests need into .venv and runs them.
#   ./scripts/test.sh           ruff, mypy, default suite (compiled build, then again as pure Python)
#                               + real-gateway + packaging tests (what CI runs)
#   ./scripts/test.sh --quick   ruff, mypy and the default suite, on the installed build (~3 min on 2 cores)
# Extra arguments after the options go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [[ "${1:-}" == "--quick" ]]; then quick=1; shift; fi
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
# The shared-store tests run against a real redis-server (Debian's); in CI they fail without it.
./scripts/install_redis.sh || [[ -z "${CI:-}" ]]
.venv/bin/python -c 'from sidecar.engine.fast import FastEngine as F; print("fast engine compiled:", F.compiled)'
status=0
# Lint, format and types (configured in pyproject.toml); a failure fails the run, the tests still run.
.venv/bin/ruff check . || status=$?
.venv/bin/ruff format --check . || status=$?
.venv/bin/mypy || status=$?
.venv/bin/python -m pytest -m "not gateway and not deploy" "$@" || status=$?
if [[ $quick == 0 ]]; then
  # The same sources uncompiled (what installs where there is no C compiler).
  SIDECAR_PURE_PYTHON=1 .venv/bin/python -m pytest -m "not gateway and not deploy" "$@" || status=$?
  ./scripts/install_gateways.sh
  .venv/bin/python -m pytest -m gateway "$@" || status=$?
  ./scripts/install_deploy_tools.sh
  ./scripts/install_browser.sh
  .venv/bin/python -m pytest -m deploy "$@" || status=$?
fi
exit $status
