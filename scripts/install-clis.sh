#!/usr/bin/env bash
# Install the pinned agent CLIs (Claude Code, Codex) into the miles-env cache, once.
# Layout: ${MILES_ENV_CACHE:-~/.cache/miles-env}/clis/<name>-<version>/node_modules/...
# The versions must match miles_env/harnesses/_cli.py (CLI_PINS). Idempotent: a finished
# install leaves a .complete marker and is skipped next time.
set -euo pipefail
CLAUDE_CODE_VERSION="${CLAUDE_CODE_VERSION:-2.1.332}"
CODEX_VERSION="${CODEX_VERSION:-0.171.0}"
root="${MILES_ENV_CACHE:-$HOME/.cache/miles-env}/clis"
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "install-clis: installing Debian's nodejs and npm"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm) >/dev/null
  fi
fi
command -v node >/dev/null || { echo "install-clis: node is not on PATH (apt-get install nodejs, or Node.js >= 18)" >&2; exit 2; }
command -v npm >/dev/null || { echo "install-clis: npm is not on PATH (apt-get install npm)" >&2; exit 2; }
install_one() {  # name package version
  local dir="$root/$1-$3"
  if [[ -f "$dir/.complete" ]]; then echo "install-clis: $2@$3 cached in $dir"; return; fi
  mkdir -p "$dir"
  echo "install-clis: npm install $2@$3 -> $dir"
  npm install --prefix "$dir" --no-audit --no-fund --loglevel=error "$2@$3"
  touch "$dir/.complete"
}
want="${1:-all}"
if [[ "$want" == all || "$want" == claude-code ]]; then install_one claude-code @anthropic-ai/claude-code "$CLAUDE_CODE_VERSION"; fi
if [[ "$want" == all || "$want" == codex ]]; then install_one codex @openai/codex "$CODEX_VERSION"; fi
