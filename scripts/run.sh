#!/usr/bin/env bash
# Set up and run the main job on the embedded defaults: agentic RL on terminal-basics, SmolLM2 on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m miles_env.cli.main train examples/terminal-cpu.yaml "$@"
