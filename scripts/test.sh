#!/usr/bin/env bash
# Installs what the tests need and runs them.
#   ./scripts/test.sh           ruff, mypy, default suite (compiled build, then again as pure Python)
#                               + real-gateway + real-agent-client (both builds) + packaging and
#                               browser tests, then the default suite on the newest other Python
#                               3.12-3.14 found (what CI runs)
#   ./scripts/test.sh --quick   ruff, mypy and the default suite, on the installed build: measured
#                               9 min 27 s on 2 cores busy with other work (the suite: 6 min 24 s)
# Extra arguments after the options go to pytest.
#
# What it installs, and where (README.md, "Quick start"):
#   both       the package and its test extra into .venv (pip); redis-server, the Debian package,
#              with apt-get as root (scripts/install_redis.sh; without root the shared-store tests
#              are skipped, and fail in CI)
#   full run   the gateways into .gateways/ (pip), the packaging linters into .tools/ (pip),
#              the agent clients into .agents/ (npm) and strace (Debian, apt-get as root;
#              scripts/install_agents.sh), Chromium, the Debian package, with apt-get (sudo when
#              not root; scripts/install_browser.sh), and .venv-newest for the newest other Python
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
.venv/bin/python -m pytest -m "not gateway and not deploy and not agents" "$@" || status=$?
if [[ $quick == 0 ]]; then
  # The same sources uncompiled (what installs where there is no C compiler).
  SIDECAR_PURE_PYTHON=1 .venv/bin/python -m pytest -m "not gateway and not deploy and not agents" "$@" || status=$?
  ./scripts/install_gateways.sh
  # The real coding-agent clients (npm, pinned, into .agents/) and strace, which the gateway
  # suite's AIPerf run needs too (it proves the load generator reaches only loopback).
  ./scripts/install_agents.sh || status=$?
  .venv/bin/python -m pytest -m gateway "$@" || status=$?
  # The agent clients through the sidecar, both builds.
  .venv/bin/python -m pytest -m agents "$@" || status=$?
  SIDECAR_PURE_PYTHON=1 .venv/bin/python -m pytest -m agents "$@" || status=$?
  ./scripts/install_deploy_tools.sh
  ./scripts/install_browser.sh
  .venv/bin/python -m pytest -m deploy "$@" || status=$?
  # The product supports Python >= 3.11: the compiled default suite again on the newest other
  # Python this machine has (its own venv, .venv-newest), or a line saying there is none.
  main_version=$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  newest=""
  for v in 3.14 3.13 3.12; do
    [[ $v != "$main_version" ]] || continue
    # On the PATH, or installed by pyenv but not selected (its shim then refuses to run).
    for candidate in "python$v" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/"python$v"; do
      if command -v "$candidate" >/dev/null && "$candidate" -c '' 2>/dev/null; then
        newest=$candidate
        break 2
      fi
    done
  done
  if [[ -n $newest ]]; then
    echo "default suite on $newest (compiled)"
    [[ -x .venv-newest/bin/python ]] || "$newest" -m venv .venv-newest
    SIDECAR_REQUIRE_COMPILED=1 .venv-newest/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
    .venv-newest/bin/python -m pytest -m "not gateway and not deploy and not agents" "$@" || status=$?
  else
    echo "default suite on a newer Python: skipped, no python3.12 to python3.14 on this machine"
  fi
fi
exit $status
