#!/usr/bin/env bash
# Install the three agent clients at the versions the e2e tests pin, from npm, into
# $AGENTS_DIR (default .cache/agents, git-ignored), with Node 24 from the npm `node` package
# when the system's node is older (OpenClaw needs Node 24). Idempotent: a stamp records the
# pinned set. Prints the bin folder to put on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${AGENTS_DIR:-.cache/agents}
PKGS=(node@24 openclaw@2026.9.6 opencode-ai@1.18.33 @anthropic-ai/claude-code@2.1.332)
STAMP="$DIR/.pinned"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "${PKGS[*]}" ]]; then
  echo "$DIR/node_modules/.bin"; exit 0
fi
command -v npm >/dev/null || { echo "install_agents: npm is needed (any Node >= 18)" >&2; exit 1; }
mkdir -p "$DIR"
npm install --prefix "$DIR" --no-audit --no-fund --no-save "${PKGS[@]}" >&2
echo "${PKGS[*]}" > "$STAMP"
echo "$DIR/node_modules/.bin"
