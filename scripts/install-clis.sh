#!/usr/bin/env bash
# Install the tested pins of the agent CLIs into the miles-env cache, once.
#   npm (Claude Code, Codex, opencode): ${MILES_ENV_CACHE:-~/.cache/miles-env}/clis/<name>-<version>/node_modules/...
#   pip (mini-swe-agent): its own venv, through scripts/install-mini-swe-agent.sh.
# Usage: install-clis.sh [all | claude-code | codex | opencode | mini-swe-agent | NAME@VERSION]
# A name installs every tested version of that CLI (newest first; the first is the harness's
# default). The versions must match miles_env/harnesses/_cli.py (TESTED); tests/test_harness_*.py
# check that they do. Idempotent: a finished install leaves a .complete marker and is skipped.
set -euo pipefail
CLAUDE_CODE_VERSIONS="${CLAUDE_CODE_VERSIONS:-2.1.332 2.0.77}"
CODEX_VERSIONS="${CODEX_VERSIONS:-0.171.0 0.169.0}"
OPENCODE_VERSIONS="${OPENCODE_VERSIONS:-1.18.33}"
here="$(cd "$(dirname "$0")" && pwd)"
root="${MILES_ENV_CACHE:-$HOME/.cache/miles-env}/clis"
want="${1:-all}"
name="${want%@*}"
only=""
[[ "$want" == *@* ]] && only="${want##*@}"
case "$name" in
  all | claude-code | codex | opencode | mini-swe-agent) ;;
  *) echo "install-clis: unknown CLI '$name' (all | claude-code | codex | opencode | mini-swe-agent)" >&2; exit 2 ;;
esac
if [[ "$name" == mini-swe-agent ]]; then exec bash "$here/install-mini-swe-agent.sh"; fi
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
install_all() {  # name package versions...
  local cli="$1" package="$2" version
  shift 2
  [[ "$name" == all || "$name" == "$cli" ]] || return 0
  if [[ -n "$only" && " $* " != *" $only "* ]]; then
    echo "install-clis: $cli $only is not a tested version (tested: $*)" >&2
    exit 2
  fi
  for version in "$@"; do
    if [[ -z "$only" || "$only" == "$version" ]]; then install_one "$cli" "$package" "$version"; fi
  done
}
# shellcheck disable=SC2086  # the version lists are meant to split
install_all claude-code @anthropic-ai/claude-code $CLAUDE_CODE_VERSIONS
# shellcheck disable=SC2086
install_all codex @openai/codex $CODEX_VERSIONS
# shellcheck disable=SC2086
install_all opencode opencode-ai $OPENCODE_VERSIONS
if [[ "$name" == all ]]; then bash "$here/install-mini-swe-agent.sh"; fi
