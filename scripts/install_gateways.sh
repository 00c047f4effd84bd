#!/usr/bin/env bash
# Install the real gateways used by the `gateway` test suite (tests/gateways/).
#
# Each gateway gets its own virtual environment under $SIDECAR_GATEWAYS_DIR
# (default: <repo>/.gateways, git-ignored):
#   smg/         PyPI smg==1.13.0           (binary: smg/bin/smg)
#   vllm-router/ PyPI vllm-router==0.1.17   (binary: vllm-router/bin/vllm-router)
#   dynamo/      PyPI ai-dynamo 1.6.1       (python -m dynamo.frontend / dynamo.mocker)
#   tiny-model/  config + tokenizer for the Dynamo mocker (no weights)
#   aiperf/      PyPI aiperf==0.13.0        (binary: aiperf/bin/aiperf; the load generator)
#
# Idempotent: a gateway whose marker file exists is skipped, so reruns are fast.
# Any failure exits non-zero (CI must fail, not skip, when a gateway cannot be installed).
#
# Usage: scripts/install_gateways.sh [smg] [vllm-router] [dynamo] [aiperf]   (default: all)
# Env:   SIDECAR_GATEWAYS_DIR   install root
#        SIDECAR_GATEWAYS_PYTHON interpreter used to create the venvs (default: python3, >= 3.10)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${SIDECAR_GATEWAYS_DIR:-$ROOT/.gateways}"
PYTHON="${SIDECAR_GATEWAYS_PYTHON:-python3}"

SMG_VERSION=1.13.0
VLLM_ROUTER_VERSION=0.1.17
DYNAMO_VERSION=1.6.1
AIPERF_VERSION=0.13.0
# Runtime dependencies of ai-dynamo, installed by hand because ai-dynamo itself is installed
# with --no-deps (its pinned `aisimulate` dependency builds from a download and fails offline;
# only the planner needs it).
DYNAMO_DEPS=(aiohttp prometheus-client pyzmq msgspec transformers tokenizers tqdm zstandard
             kubernetes redis certifi typing-extensions)


log() { printf '[install_gateways] %s\n' "$*" >&2; }

# fresh_venv NAME: (re)create an empty venv at $DIR/NAME (a partial earlier install is discarded).
# The venv gets no pip of its own (seeding one costs seconds); the base interpreter's pip
# installs into it with --python.
fresh_venv() {
  rm -rf "${DIR:?}/$1"
  "$PYTHON" -m venv --without-pip "$DIR/$1"
}

# pip_into NAME ARGS...: pip install into the venv $DIR/NAME. --no-compile skips byte-compiling
# (a third of Dynamo's install time, mostly transformers); modules compile when first imported.
pip_into() {
  local venv=$1
  shift
  "$PYTHON" -m pip --python "$DIR/$venv/bin/python" install -q --no-compile \
    --disable-pip-version-check "$@"
}

# install_cli NAME VERSION: PyPI package NAME==VERSION in the venv $DIR/NAME, whose command
# $DIR/NAME/bin/NAME must answer --help (smg, vllm-router, aiperf).
install_cli() {
  local name=$1 version=$2
  local marker="$DIR/$name/.installed-$name-$version"
  [[ -f $marker ]] && { log "$name $version: already installed"; return 0; }
  local t0=$SECONDS
  fresh_venv "$name"
  pip_into "$name" "$name==$version"
  "$DIR/$name/bin/$name" --help >/dev/null
  touch "$marker"
  log "$name $version: installed in $((SECONDS - t0)) s"
}

install_dynamo() {
  local marker="$DIR/dynamo/.installed-dynamo-$DYNAMO_VERSION"
  [[ -f $marker ]] && { log "dynamo $DYNAMO_VERSION: already installed"; return 0; }
  local t0=$SECONDS
  fresh_venv dynamo
  pip_into dynamo "ai-dynamo-runtime==$DYNAMO_VERSION" "${DYNAMO_DEPS[@]}"
  pip_into dynamo --no-deps "ai-dynamo==$DYNAMO_VERSION"
  "$DIR/dynamo/bin/python" -c 'import dynamo.frontend, dynamo.mocker' >/dev/null
  touch "$marker"
  log "dynamo $DYNAMO_VERSION: installed in $((SECONDS - t0)) s"
}

# The mocker's model directory, generated with the Dynamo venv's `tokenizers`.
install_tiny_model() {
  local marker="$DIR/tiny-model/.complete"
  [[ -f $marker ]] && { log "tiny model: already generated"; return 0; }
  rm -rf "$DIR/tiny-model"
  "$DIR/dynamo/bin/python" "$ROOT/scripts/make_tiny_model.py" "$DIR/tiny-model"
  touch "$marker"
  log "tiny model: generated in $DIR/tiny-model"
}

install_dynamo_and_model() {
  install_dynamo
  install_tiny_model
}

# The gateways install in parallel (the time is mostly Dynamo's); each job logs to
# $DIR/<gateway>.install.log, whose tail is printed when it fails. (Each job is a plain
# function call: inside an `a && b` list bash would ignore `set -e` in `a`.)
main() {
  local targets=("$@")
  [[ ${#targets[@]} -eq 0 ]] && targets=(smg vllm-router dynamo aiperf)
  "$PYTHON" -m pip --version >/dev/null || { log "$PYTHON has no pip"; exit 1; }
  mkdir -p "$DIR"
  local -A jobs=()
  local t
  for t in "${targets[@]}"; do
    case $t in
      smg) install_cli smg "$SMG_VERSION" >"$DIR/$t.install.log" 2>&1 & ;;
      vllm-router) install_cli vllm-router "$VLLM_ROUTER_VERSION" >"$DIR/$t.install.log" 2>&1 & ;;
      dynamo) install_dynamo_and_model >"$DIR/$t.install.log" 2>&1 & ;;
      aiperf) install_cli aiperf "$AIPERF_VERSION" >"$DIR/$t.install.log" 2>&1 & ;;
      *) log "unknown gateway '$t' (expected: smg, vllm-router, dynamo, aiperf)"; exit 2 ;;
    esac
    jobs[$t]=$!
  done
  local failed=0
  for t in "${!jobs[@]}"; do
    if wait "${jobs[$t]}"; then
      grep '^\[install_gateways\]' "$DIR/$t.install.log" >&2 || true
    else
      log "$t: install FAILED; output:"
      tail -n 40 "$DIR/$t.install.log" >&2 || true
      failed=1
    fi
  done
  ((failed == 0)) || exit 1
  log "gateways ready in $DIR"
}

main "$@"
