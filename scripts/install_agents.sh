#!/usr/bin/env bash
# Install the three agent clients at the versions the e2e tests pin, from npm, into
# $AGENTS_DIR (default .cache/agents, git-ignored), with Node 24 from the npm `node` package
# (OpenClaw 2026.9.6 needs Node >= 24.16 < 25 and checks it in its preinstall, so Node goes in
# first and the clients install with it first on PATH). Idempotent: a stamp records the pinned
# set. Prints the bin folder to put on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$(realpath -m "${AGENTS_DIR:-.cache/agents}")
NODE=node@24.21.0
CLIENTS=(openclaw@2026.9.6 opencode-ai@1.18.33 @anthropic-ai/claude-code@2.1.332)
PKGS=("$NODE" "${CLIENTS[@]}")
STAMP="$DIR/.pinned"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "${PKGS[*]}" ]]; then
  echo "$DIR/node_modules/.bin"; exit 0
fi
NEEDED="the agent-client e2e tests (test/e2e/test_endpoints_agent_clients.py, part of make test)
  need them; SGLANG_TEST_SKIP_AGENTS=1 skips those tests instead"
command -v npm >/dev/null || {
  echo "install_agents: npm is needed (any Node >= 18) to install ${PKGS[*]}: $NEEDED" >&2
  exit 1
}
fail() {
  echo "install_agents: npm could not install $1 from $(npm config get registry) (no network," \
    "or the registry unreachable? npm's error is above): $NEEDED" >&2
  exit 1
}
mkdir -p "$DIR"
npm install --prefix "$DIR" --no-audit --no-fund "$NODE" >&2 || fail "$NODE"
PATH="$DIR/node_modules/.bin:$PATH" \
  npm install --prefix "$DIR" --no-audit --no-fund "${PKGS[@]}" >&2 || fail "${CLIENTS[*]}"
echo "${PKGS[*]}" > "$STAMP"
echo "$DIR/node_modules/.bin"
