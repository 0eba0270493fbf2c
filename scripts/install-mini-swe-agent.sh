#!/usr/bin/env bash
# Install mini-swe-agent (PyPI, pinned) into its own virtual environment in the miles-env cache,
# once, for the mini-swe-agent harness. The harness mounts this venv read-only into the task's
# sandbox and runs `python -m minisweagent.run.mini` there, so the venv's base interpreter must be
# one the sandbox sees: the host's /usr is mirrored into it, pyenv's and /work's are not.
# Layout: ${MILES_ENV_CACHE:-~/.cache/miles-env}/clis/mini-swe-agent-<version>/{bin/python,lib/...}
# Installs exactly miles_env/harnesses/locks/mini-swe-agent.txt (pip --no-deps, then pip check).
#   --lock   re-resolve mini-swe-agent==<version> in a fresh venv and rewrite that lock file.
# Idempotent: a finished install leaves a .complete marker and is skipped next time.
set -euo pipefail
MINI_SWE_AGENT_VERSION="2.4.6"  # keep in sync with miles_env/harnesses/mini_swe_agent.py (MINI_SWE_AGENT)
# Not $PYTHON: setup and CI point that at the main (virtual) environment, which the sandbox cannot see.
PYTHON="${MINI_SWE_AGENT_PYTHON:-/usr/bin/python3}"
here="$(cd "$(dirname "$0")" && pwd)"
lock="$here/../miles_env/harnesses/locks/mini-swe-agent.txt"
root="${MILES_ENV_CACHE:-$HOME/.cache/miles-env}/clis"
dir="$root/mini-swe-agent-$MINI_SWE_AGENT_VERSION"
relock=0
[[ "${1:-}" == --lock ]] && relock=1
if [[ -f "$dir/.complete" && $relock == 0 ]]; then
  echo "install-mini-swe-agent: mini-swe-agent==$MINI_SWE_AGENT_VERSION cached in $dir"; exit 0
fi
command -v "$PYTHON" >/dev/null || { echo "install-mini-swe-agent: $PYTHON not found (set MINI_SWE_AGENT_PYTHON=...)" >&2; exit 2; }
real="$(readlink -f "$(command -v "$PYTHON")")"
case "$real" in
  /usr/* | /bin/* | /opt/*) ;;
  *) echo "install-mini-swe-agent: $PYTHON is $real, which the sandbox cannot see; use an interpreter under /usr or /opt (MINI_SWE_AGENT_PYTHON=/usr/bin/python3)" >&2; exit 2 ;;
esac
if ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "install-mini-swe-agent: installing Debian's python3-venv"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv) >/dev/null
  fi
  "$PYTHON" -c 'import ensurepip, venv' || { echo "install-mini-swe-agent: $PYTHON has no venv/ensurepip (apt-get install python3-venv)" >&2; exit 2; }
fi
pyver="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ $relock == 0 ]] && ! head -1 "$lock" | grep -q "Python $pyver)"; then
  echo "install-mini-swe-agent: $lock was resolved for $(head -1 "$lock" | grep -o 'Python [0-9.]*'), $PYTHON is $pyver: use that Python (MINI_SWE_AGENT_PYTHON=...) or run with --lock" >&2
  exit 2
fi
mkdir -p "$root"
exec 9>"$root/.mini-swe-agent-$MINI_SWE_AGENT_VERSION.lock"
flock 9  # the harness's own first-use install takes the same lock
if [[ -f "$dir/.complete" && $relock == 0 ]]; then exit 0; fi
echo "install-mini-swe-agent: mini-swe-agent==$MINI_SWE_AGENT_VERSION (Python $pyver) -> $dir"
rm -rf "$dir"
"$PYTHON" -m venv "$dir"
py="$dir/bin/python"
if [[ $relock == 1 ]]; then
  "$py" -m pip install --quiet --disable-pip-version-check "mini-swe-agent==$MINI_SWE_AGENT_VERSION"
  {
    echo "# the mini-swe-agent venv (installed under \$MILES_ENV_CACHE, Python $pyver) as resolved by its installer."
    echo "# Regenerate with: scripts/install-mini-swe-agent.sh --lock   (pip freeze of a fresh venv; do not edit by hand)"
    "$py" -m pip freeze --disable-pip-version-check
  } > "$lock"
  echo "install-mini-swe-agent: wrote $lock"
else
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps -r "$lock"
fi
"$py" -m pip check --disable-pip-version-check
# Offline: litellm's bundled cost map instead of fetching it at import.
LITELLM_LOCAL_MODEL_COST_MAP=True MSWEA_SILENT_STARTUP=1 "$py" -c \
  "import minisweagent.run.mini, litellm, importlib.metadata as m; print('install-mini-swe-agent: ok, mini-swe-agent', m.version('mini-swe-agent'), 'litellm', m.version('litellm'))" </dev/null
touch "$dir/.complete"
