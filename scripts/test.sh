#!/usr/bin/env bash
# Set up, lint, type-check and run the whole test suite (slow end-to-end tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
$PY -m ruff check .
$PY -m ruff format --check .
$PY -m mypy miles_env
$PY -m pytest -q "$@"
