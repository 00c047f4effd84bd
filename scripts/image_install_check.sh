#!/usr/bin/env bash
# Check the container image's install path without a Docker engine.
#
# Runs the Dockerfile's install commands in a temp dir: a build context holding only what
# .dockerignore lets through, `pip wheel` of the package with the build stage's
# SIDECAR_REQUIRE_COMPILED=1 (first with a C compiler that always fails, which must fail the
# build, then for real), a fresh venv (the image's /opt/sidecar) with the wheel installed and
# pip removed. The venv is then made read-only and the installed `sidecar` is exercised with
# the image's environment, in a private mount namespace whose root filesystem is remounted
# read-only (as with readOnlyRootFilesystem) when the kernel allows it, else with the venv's
# write bits removed:
#   sidecar --help; the fast engine runs compiled; sidecar check-config (with the tokens file) on
#   config/examples/*.yaml (or `sidecar modes` when there are none); `sidecar run` with the
#   admin listener on 0.0.0.0 as in the image: without a tokens file it must refuse to start
#   naming admin_insecure / admin_tokens_file; with a read-only tokens file, against a loopback
#   upstream: /healthz, /readyz, /metrics without a token, /v1/sessions 401 without and 200 with
#   the admin token, a proxied request, then SIGTERM and a clean exit.
#
# Interpreter: $SIDECAR_IMAGE_PYTHON, else Python 3.12 (the image's base), else python3 >= 3.11.
set -euo pipefail

if [[ "${1:-}" == "--run-checks" ]]; then
  # Second half, possibly inside the read-only namespace: $2 = venv, $3 = repo root,
  # $4 = a read-only tokens file (the image's /etc/sidecar/tokens/tokens.yaml).
  venv="$2"
  repo="$3"
  tokens_file="$4"
  export PATH="$venv/bin:$PATH" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/nonexistent
  # The image's defaults; the run checks below use free ports (the proxy on loopback).
  export SIDECAR_LISTEN=0.0.0.0:8080 SIDECAR_ADMIN=0.0.0.0:9091
  cd /

  echo "+ sidecar --help"
  sidecar --help >/dev/null
  # The build stage has a C compiler: the wheel carries the fast engine's compiled modules.
  echo "+ the fast engine runs compiled, with the llhttp request parser"
  python -c 'from sidecar.engine.fast import FastEngine; assert FastEngine.compiled, "fast engine not compiled"'
  python -c 'from sidecar.engine.parsers import RequestParser as P; assert P.__module__ == "sidecar.engine.llhttp_parser", P'
  shopt -s nullglob
  examples=("$repo"/config/examples/*.yaml "$repo"/config/examples/*.yml)
  if ((${#examples[@]})); then
    for example in "${examples[@]}"; do
      # check-config applies the environment like `run`: with the image's 0.0.0.0 admin
      # listener it needs the tokens file too.
      echo "+ SIDECAR_ADMIN_TOKENS_FILE=... sidecar check-config config/examples/$(basename "$example")"
      SIDECAR_ADMIN_TOKENS_FILE="$tokens_file" sidecar check-config "$example" >/dev/null
    done
  else
    echo "+ sidecar modes"
    sidecar modes
  fi

  echo "+ sidecar run without tokens on 0.0.0.0 (must refuse), then with a tokens file (image defaults)"
  "$venv/bin/python" - "$tokens_file" <<'EOF'
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKENS_FILE = sys.argv[1]
ADMIN_TOKEN = re.search(r"token:\s*(\S+)", open(TOKENS_FILE, encoding="utf-8").read()).group(1)


class Upstream(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        body = json.dumps({"object": "list", "data": [{"id": "m"}], "path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_for(url: str, want: int, deadline: float) -> int:
    status = 0
    while time.monotonic() < deadline:
        try:
            status, _ = get(url)
        except OSError:
            status = 0
        if status == want:
            return status
        time.sleep(0.2)
    return status


upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
threading.Thread(target=upstream.serve_forever, daemon=True).start()
listen, admin = free_port(), free_port()
env = {k: v for k, v in os.environ.items() if k not in ("SIDECAR_ADMIN_TOKENS_FILE", "SIDECAR_ADMIN_INSECURE")}
env.update(
    SIDECAR_UPSTREAM=f"http://127.0.0.1:{upstream.server_address[1]}",
    SIDECAR_LISTEN=f"127.0.0.1:{listen}",
    # As in the image: all interfaces, so that probes from outside the container reach it.
    SIDECAR_ADMIN=f"0.0.0.0:{admin}",
    SIDECAR_DRAIN_GRACE_SECONDS="1",
)

# 1. No tokens file, no admin_insecure, admin on 0.0.0.0: the sidecar must refuse to start.
try:
    refused = subprocess.run(["sidecar", "run"], env=env, capture_output=True, text=True, timeout=30)
except subprocess.TimeoutExpired:
    upstream.shutdown()
    sys.exit("sidecar run check failed: started with an unauthenticated sessions API on 0.0.0.0")
if refused.returncode != 2 or not all(s in refused.stderr for s in ("admin_insecure", "admin_tokens_file")):
    upstream.shutdown()
    sys.exit(f"sidecar run check failed: without tokens expected exit 2 naming admin_insecure and "
             f"admin_tokens_file, got exit {refused.returncode}: {refused.stderr[-500:]!r}")
print("sidecar run without tokens: refused (exit 2, names admin_insecure / admin_tokens_file)")

# 2. With the (read-only) tokens file: starts; probes and metrics open, sessions API needs the token.
env["SIDECAR_ADMIN_TOKENS_FILE"] = TOKENS_FILE
proc = subprocess.Popen(["sidecar", "run"], env=env)
base = f"http://127.0.0.1:{admin}"
failure = ""
try:
    deadline = time.monotonic() + 30
    if wait_for(f"{base}/healthz", 200, deadline) != 200:
        failure = "/healthz never answered 200"
    else:
        status, body = get(f"http://127.0.0.1:{listen}/v1/models")
        if status != 200 or b'"path": "/v1/models"' not in body:
            failure = f"proxied GET /v1/models: {status} {body[:200]!r}"
        elif (got := wait_for(f"{base}/readyz", 200, time.monotonic() + 15)) != 200:
            failure = f"/readyz answered {got} after the upstream was reached"
        else:
            checks = [("/metrics", None, 200), ("/v1/sessions", None, 401),
                      ("/v1/sessions", "not-the-token-0123456789", 401), ("/ui/data.json", None, 401),
                      ("/v1/sessions", ADMIN_TOKEN, 200)]
            for path, token, want in checks:
                status, body = get(base + path, token)
                if status != want:
                    who = "the admin token" if token == ADMIN_TOKEN else "a wrong token" if token else "no token"
                    failure = f"GET {path} with {who}: {status} (want {want}) {body[:200]!r}"
                    break
finally:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        failure = failure or "no exit within 30 s of SIGTERM"
    upstream.shutdown()
if not failure and code != 0:
    failure = f"exit code {code} after SIGTERM"
if failure:
    sys.exit(f"sidecar run check failed: {failure}")
print("sidecar run with a tokens file: /healthz 200, proxied request 200, /readyz 200, /metrics 200, "
      "/v1/sessions 401 without / 200 with the token, SIGTERM -> exit 0")
EOF
  exit 0
fi

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
self="$repo_root/scripts/image_install_check.sh"

find_python() {
  local candidate version
  local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
  local candidates=("${SIDECAR_IMAGE_PYTHON:-}" python3.12)
  # Newest first; an unmatched glob stays literal and fails the run check below.
  while IFS= read -r version; do
    candidates+=("$version/bin/python3")
  done < <(printf '%s\n' "$pyenv_root"/versions/3.12.* | sort -rV)
  candidates+=(python3)
  for candidate in "${candidates[@]}"; do
    [[ -n "$candidate" ]] || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

if ! python="$(find_python)"; then
  echo "error: no Python >= 3.11 found; set SIDECAR_IMAGE_PYTHON" >&2
  exit 1
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/sidecar-image-check.XXXXXX")"
cleanup() {
  chmod -R u+w "$work" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

echo "image install check with $("$python" --version) in $work"

# Build context: COPY . . after .dockerignore (an allow-list of `!path` lines).
context="$work/context"
mkdir -p "$context"
while IFS= read -r line; do
  path="${line#!}"
  path="${path%/}"
  if [[ -e "$repo_root/$path" ]]; then
    mkdir -p "$context/$(dirname "$path")"
    cp -a "$repo_root/$path" "$context/$path"
  fi
done < <(grep -E '^![^*]' "$repo_root/.dockerignore")
# ... minus what .dockerignore excludes: bytecode anywhere, and the C files and modules that an
# editable install compiled in place inside sidecar/ (vendor/llhttp's C sources stay).
find "$context" \( -name __pycache__ -o -name '*.py[cod]' \) -prune -exec rm -rf {} +
find "$context/sidecar" \( -name '*.so' -o -name '*.c' \) -exec rm -f {} +

# Build stage (the base image's interpreter is a throwaway venv here), with the build stage's
# SIDECAR_REQUIRE_COMPILED=1.
"$python" -m venv "$work/base"
export PIP_DISABLE_PIP_VERSION_CHECK=1
grep -q '^    SIDECAR_REQUIRE_COMPILED=1$' "$repo_root/Dockerfile" \
  || { echo "error: the Dockerfile's build stage no longer sets SIDECAR_REQUIRE_COMPILED=1" >&2; exit 1; }
export SIDECAR_REQUIRE_COMPILED=1
# A compile that fails (here: a C compiler that always fails) must fail the build, not fall back
# to the pure-Python modules.
echo "+ CC=false pip wheel --no-deps . (must fail)"
if (cd "$context" && CC=false "$work/base/bin/python" -m pip wheel --quiet --no-cache-dir --no-deps \
      --wheel-dir "$work/broken-wheels" . >"$work/broken-build.log" 2>&1); then
  echo "error: with SIDECAR_REQUIRE_COMPILED=1 a failed compile still built a wheel:" >&2
  ls "$work/broken-wheels" >&2
  exit 1
fi
grep -q "Failed building wheel" "$work/broken-build.log" \
  || { echo "error: the failed build did not fail in the wheel build:" >&2; tail -20 "$work/broken-build.log" >&2; exit 1; }
echo "failed compile: the wheel build failed, as required"
rm -rf "$context/build" "$context"/*.egg-info
echo "+ pip wheel --no-deps ."
(cd "$context" && "$work/base/bin/python" -m pip wheel --quiet --no-cache-dir --no-deps --wheel-dir "$work/wheels" .)
venv="$work/opt-sidecar"
echo "+ python -m venv /opt/sidecar && pip install sidecar wheel && pip uninstall pip"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --no-cache-dir "$work"/wheels/*.whl
"$venv/bin/python" -m pip uninstall --quiet --yes pip

# Runtime stage: nothing under the venv may be written any more.
chmod -R a-w "$venv"
# A tokens file with one admin token, read-only like the mounted Secret in Kubernetes.
tokens_file="$work/tokens/tokens.yaml"
mkdir -p "$work/tokens"
printf 'tokens:\n  - token: %s\n    admin: true\n' "$("$python" -c 'import secrets; print(secrets.token_hex(16))')" \
  >"$tokens_file"
chmod 0444 "$tokens_file"
if unshare --mount --propagation private true 2>/dev/null; then
  echo "read-only root: private mount namespace with / and $work remounted read-only"
  # In `bash -c`, $0 is the script and "$@" its arguments; $RO_DIR may be its own mount.
  # shellcheck disable=SC2016  # expanded by the inner shell
  RO_DIR="$work" unshare --mount --propagation private bash -c '
    mount -o remount,bind,ro / &&
      mount --bind "$RO_DIR" "$RO_DIR" && mount -o remount,bind,ro "$RO_DIR" &&
      exec bash "$0" "$@"' "$self" --run-checks "$venv" "$repo_root" "$tokens_file"
else
  echo "read-only root: venv write bits removed (no mount namespace available)"
  bash "$self" --run-checks "$venv" "$repo_root" "$tokens_file"
fi
echo "image install check passed"
