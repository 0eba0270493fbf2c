"""`miles-env env validate`: the registration gate passes good environments and names what is
wrong with bad ones; every Episode and run config records the environment's distribution.

The bad environment is planted as a module on PYTHONPATH (`bad_env:BadEnv`): one task whose
reference solution scores 0, one a do-nothing agent passes, one whose verifier gives the same
final state another reward on later calls. The 2-step GRPO stage runs for real: on the tiny
model for the scaffold (fast) and on SmolLM2 itself for terminal-basics (slow).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from miles_env.cli.env import scaffold
from miles_env.validate import validate_env

BAD_ENV = """
from miles_env.checks import ChecksEnvironment
from miles_env.registry import make_task
from miles_env.types import Reward

NAME = "bad-env"
_calls = {}


class BadEnv(ChecksEnvironment):
    name = NAME
    splits = ("train",)

    def tasks(self, split=None):
        check = [{"kind": "file_equals", "path": "out.txt", "text": "ok", "strip": True}]
        return [
            make_task(id="good", env=NAME, instruction="Write ok to out.txt.",
                      verifier={"checks": check}, solution="echo ok > out.txt"),
            make_task(id="oracle-zero", env=NAME, instruction="Write ok to out.txt.",
                      verifier={"checks": check}, solution="echo wrong > out.txt"),
            make_task(id="nop-passes", env=NAME, instruction="Do not create junk.txt.",
                      verifier={"checks": [{"kind": "file_absent", "path": "junk.txt"}]}, solution="true"),
            make_task(id="flaky", env=NAME, instruction="Write ok to out.txt.",
                      verifier={"checks": check}, solution="echo ok > out.txt", metadata={"flaky": True}),
        ]

    async def verify(self, task, sandbox, transcript):
        reward = await super().verify(task, sandbox, transcript)
        if task.metadata.get("flaky"):  # right the first time on a sandbox, then the opposite
            _calls[id(sandbox)] = _calls.get(id(sandbox), 0) + 1
            if _calls[id(sandbox)] > 1:
                return Reward(score=1.0 - reward.score, details=reward.details)
        return reward
"""


def _cli(args: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    with log.open("wb") as out:
        cmd = [sys.executable, "-m", "miles_env.cli.main", "env", "validate", *args]
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=900).returncode


@pytest.mark.parametrize("name", ["terminal-basics", "terminal-hard"])
def test_builtin_environments_pass(name: str) -> None:
    report = validate_env(name, quick=True)
    assert report.passed, report.render()
    assert [s.name for s in report.stages] == ["schema", "oracle", "nop", "determinism", "train"]
    assert report.stage("train").skipped and "--quick" in report.stage("train").summary
    assert report.distribution == {"name": f"miles-env-{name}", "version": "0.1.0"}
    assert report.stage("oracle").summary.startswith(f"{report.n_tasks}/{report.n_tasks} ")


def test_planted_bad_environment_fails_with_a_clear_report(tmp_path: Path) -> None:
    (tmp_path / "bad_env.py").write_text(BAD_ENV)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    report_path = tmp_path / "report.json"
    rc = _cli(["bad_env:BadEnv", "--quick", "--report", str(report_path)], tmp_path / "out.txt", env)
    text = (tmp_path / "out.txt").read_text()
    assert rc == 1, text
    stages = {s["name"]: s for s in json.loads(report_path.read_text())["stages"]}
    assert stages["schema"]["passed"]
    assert not stages["oracle"]["passed"] and stages["oracle"]["problems"] == [
        "oracle-zero: oracle scored 0, want 1"
    ]
    assert not stages["nop"]["passed"]
    assert stages["nop"]["problems"] == ["nop-passes: a do-nothing agent scores 1"]
    assert not stages["determinism"]["passed"]
    assert [p.split(" ")[0] for p in stages["determinism"]["problems"]] == ["flaky", "flaky"]  # oracle, nop
    assert stages["train"]["skipped"]
    for needle in ("FAIL  oracle", "oracle-zero", "FAIL  nop", "nop-passes", "FAIL  determinism", "flaky"):
        assert needle in text, text
    assert text.rstrip().endswith("FAILED")


def test_unknown_environment_is_a_failed_schema_stage(tmp_path: Path) -> None:
    report = validate_env("no-such-env-anywhere", quick=True)
    assert not report.passed
    assert "unknown environment 'no-such-env-anywhere'" in report.stage("schema").problems[0]
    assert all(s.skipped for s in report.stages[1:])


def _episode_dists(run_dir: Path) -> list[dict[str, str]]:
    with sqlite3.connect(run_dir / "queue.db") as db:
        return [json.loads(m)["metadata"]["env_dist"] for (m,) in db.execute("SELECT meta FROM episodes")]


def test_scaffold_passes_out_of_the_box_with_the_training_stage(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`env init`'s package, unmodified, passes every stage, 2 GRPO steps included; the run's
    config and each of its episodes record where the environment came from."""
    scaffold("my-tasks", tmp_path / "pkg")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'pkg'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    work = tmp_path / "work"
    report = validate_env("miles_env_my_tasks:MyTasksEnv", model=str(tiny_model), work_dir=work)
    assert report.passed, report.render()
    assert not report.stage("train").skipped
    run_dir = work / "train-run"
    want = {"name": "miles_env_my_tasks", "version": "unknown"}  # on sys.path, not installed
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["env_dist"] == want
    dists = _episode_dists(run_dir)
    assert len(dists) == 4 and all(d == want for d in dists)  # 2 steps x 1 group of 2


@pytest.mark.slow
def test_terminal_basics_trains_two_steps_on_smollm2(tmp_path: Path) -> None:
    """The full gate on a built-in environment: the real SmolLM2 through the real loop."""
    report = validate_env("terminal-basics", work_dir=tmp_path)
    assert report.passed, report.render()
    run_dir = tmp_path / "train-run"
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["engine"]["model"] == "smollm2"
    assert cfg["env_dist"] == {"name": "miles-env-terminal-basics", "version": "0.1.0"}
    assert _episode_dists(run_dir) and all(
        d["name"] == "miles-env-terminal-basics" for d in _episode_dists(run_dir)
    )


def test_harbor_tasks_are_versioned_by_their_content(tmp_path: Path) -> None:
    """Task files are not a package: their version is a hash of every file, so any edit shows."""
    import shutil

    from miles_env.provenance import env_distribution
    from miles_env.registry import load_environment

    src = Path(__file__).resolve().parents[1] / "examples" / "harbor-tasks" / "fix-invoice"
    shutil.copytree(src, tmp_path / "fix-invoice")
    before = env_distribution(load_environment(f"harbor:{tmp_path}"))
    assert before["name"] == "harbor-tasks" and before == env_distribution(
        load_environment(f"harbor:{tmp_path}")
    )
    (tmp_path / "fix-invoice" / "tests" / "check_totals.py").write_text("# edited\n")
    after = env_distribution(load_environment(f"harbor:{tmp_path}"))
    assert after["name"] == "harbor-tasks" and after["version"] != before["version"]


def test_worker_adapters_record_the_locked_framework_version() -> None:
    from miles_env.provenance import env_distribution
    from miles_env.registry import load_environment

    lock = Path(__file__).resolve().parents[1] / "adapters" / "locks" / "verifiers.txt"
    pin = next(x for x in lock.read_text().splitlines() if x.startswith("verifiers=="))
    env = load_environment("verifiers:vf_say_word", validate=False)  # no worker is started
    assert env_distribution(env) == {"name": "verifiers", "version": pin.split("==")[1]}


def test_a_probe_error_keeps_its_first_line_and_its_last_lines() -> None:
    """A failed image build's message is a headline, then the builder's log: the report keeps the
    headline whole and the log's end (the failing step), not the first 500 characters."""
    from miles_env.errors import SandboxError
    from miles_env.validate.probes import TAIL_LINES, _headline

    log = "\n".join(f"Setting up package-{i} ..." for i in range(200))
    e = SandboxError(
        "building Dockerfile failed: exit 6; a RUN step needs github.com\n" + log + "\nError: exit status 6"
    )
    lines = _headline(e).splitlines()
    assert lines[0] == "SandboxError: building Dockerfile failed: exit 6; a RUN step needs github.com"
    assert lines[-1] == "Error: exit status 6" and len(lines) == 1 + TAIL_LINES
    assert _headline(SandboxError("one line")) == "SandboxError: one line"
