"""Our own Harbor-format tasks (examples/harbor-tasks): oracle 1.0 and do-nothing 0.0 on every
task, on the local provider (the Dockerfile built by buildah, `FROM python:3.11-slim` through the
session's bootstrapped bases and the alias table) and on the docker provider (built by a real
dockerd from scripts/start-dockerd.sh); a near-miss solution scores 0, so the verifiers check
the task and not just a file's presence.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from miles_env.adapters.harbor.taskdir import final_stage
from miles_env.oracle import run_solution
from miles_env.registry import load_environment
from miles_env.validate import validate_env
from miles_env.validate.probes import run_probes

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "harbor-tasks"
NAMES = ["fix-invoice", "log-digest", "restore-backup"]

# A plausible wrong answer per task: each must score 0.
NEAR_MISS = {
    # only the current log, not the rotated gzip ones
    "log-digest": "mkdir -p /app/report && grep -E '\" 5[0-9]{2} ' /app/logs/access-1.log | cut -d' ' -f1 "
    "| sort | uniq -c | sort -k1,1nr -k2,2 | head -3 | sed -E 's/^ *([0-9]+) (.*)$/\\2 \\1/' "
    "> /app/report/top_errors.txt",
    # the percentage read as a fraction
    "fix-invoice": "sed -i 's|return gross - discount_pct .*|return gross * (1 - discount_pct)|' "
    "/app/src/calc/__init__.py",
    # every file restored and listed, not only the corrupted ones
    "restore-backup": "cd /app/site && tar -xzf /app/backups/site.tar.gz && find . -type f | sed 's#^./##' "
    "| sort > /app/restored.txt",
}


@pytest.fixture(scope="module")
def docker_engine() -> str:
    """A real dockerd with the offline base image; skip (a failure under CI=true) when impossible."""
    try:
        r = subprocess.run(
            ["bash", str(ROOT / "scripts" / "start-dockerd.sh")], capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"docker engine unavailable: scripts/start-dockerd.sh: {e}")
    if r.returncode != 0:
        pytest.skip(f"docker engine unavailable: start-dockerd.sh exit {r.returncode}: {r.stderr[-400:]}")
    return "unix:///var/run/docker.sock"


def test_the_tasks_are_harbor_format_with_nontrivial_dockerfiles() -> None:
    assert sorted(p.name for p in TASKS.iterdir() if p.is_dir()) == NAMES
    for name in NAMES:
        d = TASKS / name
        for rel in ("task.toml", "instruction.md", "tests/test.sh", "solution/solve.sh"):
            assert (d / rel).is_file(), d / rel
        assert "/logs/verifier/reward.txt" in (d / "tests" / "test.sh").read_text()
        ops = [i.op for i in final_stage((d / "environment" / "Dockerfile").read_text())]
        assert ops.count("RUN") >= 2 and "COPY" in ops and "WORKDIR" in ops and "ENV" in ops, (name, ops)


def _probe_all(provider_name: str) -> dict[str, tuple[float, float]]:
    from miles_env.sandboxes import get_provider

    env = load_environment(f"harbor:{TASKS}")
    tasks = env.tasks("test")
    oracle, nop = anyio.run(run_probes, env, tasks, get_provider(provider_name), 3)
    for p in [*oracle, *nop]:
        assert p.error is None, (provider_name, p.task_id, p.error)
    return {o.task_id: (o.score, n.score) for o, n in zip(oracle, nop, strict=True)}


def test_oracle_one_and_nop_zero_on_the_local_provider(image_bases: Any) -> None:
    assert _probe_all("local") == {name: (1.0, 0.0) for name in NAMES}


@pytest.mark.slow
def test_oracle_one_and_nop_zero_on_the_docker_provider(docker_engine: str) -> None:
    assert _probe_all("docker") == {name: (1.0, 0.0) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_a_near_miss_scores_zero(name: str, image_bases: Any) -> None:
    from miles_env.sandboxes import get_provider

    env = load_environment(f"harbor:{TASKS / name}")
    (task,) = env.tasks("test")
    res = anyio.run(run_solution, env, task, get_provider("local"), NEAR_MISS[name])
    assert res.error is None and res.solution_exit_code == 0, (res.error, res.solution_stderr)
    assert res.score == 0.0, res.details


def test_env_validate_takes_the_directory(image_bases: Any) -> None:
    """A directory of Harbor tasks is validated as `harbor:<dir>`, versioned by its content hash."""
    report = validate_env(str(TASKS), quick=True)
    assert report.passed, report.render()
    assert report.env == f"harbor:{TASKS}" and report.n_tasks == 3
    assert report.distribution["name"] == "harbor-tasks"
    assert report.distribution["version"].startswith("sha256:")


def test_env_validate_trains_on_the_directory(tmp_path: Path, tiny_model: Path, image_bases: Any) -> None:
    """The full gate on the directory: its tasks train through `harbor:<dir>?split=train`."""
    report = validate_env(str(TASKS), model=str(tiny_model), work_dir=tmp_path)
    assert report.passed, report.render()
    assert f"harbor:{TASKS}?split=train" in report.stage("train").summary
    cfg = yaml.safe_load((tmp_path / "train-run" / "config.yaml").read_text())
    assert cfg["env_dist"] == report.distribution
