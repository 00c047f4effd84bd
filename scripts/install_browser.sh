#!/usr/bin/env bash
# Install Chromium for the live session view's browser tests (tests/ui, `deploy` marker).
#
# Debian/Ubuntu: `apt-get install -y chromium` when no chromium is on PATH (sudo when not root).
# Idempotent: does nothing when chromium is already installed. Exits non-zero on failure.
set -euo pipefail

find_chromium() {
  command -v chromium 2>/dev/null || command -v chromium-browser 2>/dev/null
}

if bin="$(find_chromium)"; then
  echo "chromium already installed: $("$bin" --version 2>/dev/null || echo "$bin")"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_browser.sh: no apt-get here; install Chromium and put it on PATH as 'chromium'" >&2
  exit 1
fi

as_root=()
if [[ "$(id -u)" -ne 0 ]]; then
  as_root=(sudo)
fi

export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update
"${as_root[@]}" apt-get install -y chromium

bin="$(find_chromium)" || { echo "install_browser.sh: chromium still not on PATH" >&2; exit 1; }
echo "chromium installed: $("$bin" --version 2>/dev/null || echo "$bin")"
