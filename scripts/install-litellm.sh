#!/usr/bin/env bash
# Install LiteLLM's proxy server (litellm[proxy], pinned) into its own virtual environment in the
# miles-env cache, once, for bench/bench_tito.py's comparison. It never touches the main
# environment's packages: the bench starts it as a subprocess from this venv.
# Layout: ${MILES_ENV_CACHE:-~/.cache/miles-env}/bench/litellm/{bin/litellm,...}
# Idempotent: a finished install leaves a .complete marker and is skipped next time.
set -euo pipefail
LITELLM_VERSION="${LITELLM_VERSION:-1.108.6}"
PYTHON="${PYTHON:-python3.11}"
dir="${MILES_ENV_CACHE:-$HOME/.cache/miles-env}/bench/litellm"
marker="$dir/.complete-litellm-$LITELLM_VERSION"
if [[ -f "$marker" ]]; then echo "install-litellm: litellm[proxy]==$LITELLM_VERSION cached in $dir"; exit 0; fi
command -v "$PYTHON" >/dev/null || { echo "install-litellm: $PYTHON is not on PATH (set PYTHON=...)" >&2; exit 2; }
echo "install-litellm: litellm[proxy]==$LITELLM_VERSION -> $dir"
rm -rf "$dir"
"$PYTHON" -m venv "$dir"
py="$dir/bin/python"
"$py" -m pip install --quiet --upgrade pip
"$py" -m pip install --quiet "litellm[proxy]==$LITELLM_VERSION"
# Offline: the bundled model cost map instead of fetching it from GitHub at import.
LITELLM_LOCAL_MODEL_COST_MAP=True "$py" -c \
  "import litellm.proxy.proxy_server, importlib.metadata as m; print('install-litellm: ok, litellm', m.version('litellm'))"
touch "$marker"
