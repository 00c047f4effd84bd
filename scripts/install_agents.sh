#!/usr/bin/env bash
# Install the real coding-agent clients used by the `agents` test suite (tests/agents/), from the
# npm registry, pinned, into a project-local folder (never globally):
#   $SIDECAR_AGENTS_DIR (default: <repo>/.agents, git-ignored)
#     node_modules/@anthropic-ai/claude-code   Claude Code
#     node_modules/@openai/codex               Codex CLI (its native binary in @openai/codex-linux-*)
#     node_modules/opencode-ai                 opencode (its native binary in opencode-linux-*)
#
# Idempotent: a marker file names the installed versions, so reruns take a second. Needs Node.js
# >= 18 with npm and access to the npm registry (or a mirror: NPM_CONFIG_REGISTRY), and strace.
# Without Node it says so and exits 0 (the suite then skips, saying why; in CI it fails instead).
#
# Usage: scripts/install_agents.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${SIDECAR_AGENTS_DIR:-$ROOT/.agents}"

CLAUDE_CODE_VERSION=2.1.197
CODEX_VERSION=0.171.0
OPENCODE_VERSION=1.18.33

log() { printf '[install_agents] %s\n' "$*" >&2; }

# The suite records every address a client tries with strace (Debian's, installed when missing
# and this runs as root, as in CI).
if ! command -v strace >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    log "installing strace with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends strace >/dev/null
  else
    log "strace is not installed and installing it needs root (apt-get install strace): the suite will be skipped"
  fi
fi

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  log "node and npm are not installed: the agents suite will be skipped (install Node.js >= 18)"
  exit 0
fi

marker="$DIR/.installed-claude-code-$CLAUDE_CODE_VERSION-codex-$CODEX_VERSION-opencode-$OPENCODE_VERSION"
if [[ -f $marker ]]; then
  log "already installed: claude-code $CLAUDE_CODE_VERSION, codex $CODEX_VERSION, opencode $OPENCODE_VERSION"
  exit 0
fi
t0=$SECONDS
rm -rf "${DIR:?}"
mkdir -p "$DIR"
# A package.json of its own: npm installs into $DIR/node_modules and never walks up to another
# project, nor writes anything global.
printf '{"name": "sidecar-agents", "private": true}\n' > "$DIR/package.json"
npm install --prefix "$DIR" --no-audit --no-fund --loglevel=error --save-exact \
  "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" \
  "@openai/codex@$CODEX_VERSION" \
  "opencode-ai@$OPENCODE_VERSION"
touch "$marker"
log "installed claude-code $CLAUDE_CODE_VERSION, codex $CODEX_VERSION, opencode $OPENCODE_VERSION in $((SECONDS - t0)) s"
