"""`miles-env env list|info|init|eval` with the real registry, sandbox and (slow) a real pip install."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid

import pytest
from typer.testing import CliRunner

from miles_env.cli.env import app

runner = CliRunner()

_BROKEN_ENV = """
from miles_env.checks import ChecksEnvironment
from miles_env.types import Task


class Wrong(ChecksEnvironment):
    name = "wrong"

    def tasks(self, split=None):
        ts = [
            Task(id="good", env="wrong", instruction="i", solution="echo hi > a.txt",
                 verifier={"checks": [{"kind": "file_equals", "path": "a.txt", "text": "hi", "strip": True}]}),
            Task(id="bad", env="wrong", instruction="i", split="test", solution="echo ho > a.txt",
                 verifier={"checks": [{"kind": "file_equals", "path": "a.txt", "text": "hi", "strip": True}]}),
        ]
        return [t for t in ts if split is None or t.split == split]
"""


@pytest.fixture
def wrong_env(tmp_path, monkeypatch):
    (tmp_path / "wrong_env_mod.py").write_text(_BROKEN_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "wrong_env_mod:Wrong"


def test_list_json_shows_installed_envs_with_source_and_counts():
    res = runner.invoke(app, ["list", "--json"])
    assert res.exit_code == 0, res.output
    by_name = {e["name"]: e for e in json.loads(res.stdout)}
    basics = by_name["terminal-basics"]
    assert basics["source"].startswith("miles-env-terminal-basics ")
    assert basics["n_tasks"]["train"] >= 30 and basics["n_tasks"]["test"] >= 12
    assert by_name["terminal-hard"]["error"] is None


def test_list_table_and_explicit_module(wrong_env):
    res = runner.invoke(app, ["list", "--module", wrong_env], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "terminal-basics" in res.stdout and "terminal-hard" in res.stdout
    assert wrong_env in res.stdout and "module" in res.stdout
    res = runner.invoke(app, ["list", "-m", "no_such_mod_q:x"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "failed to load" in res.stdout
    assert "no_such_mod_q:x: environment 'no_such_mod_q:x' failed to load: ModuleNotFoundError" in res.stderr


def test_info_json_has_splits_tiers_and_examples():
    res = runner.invoke(app, ["info", "terminal-basics", "--json", "--examples", "2"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["name"] == "terminal-basics" and info["description"]
    for split in ("train", "test"):
        s = info["splits"][split]
        assert set(s["tiers"]) == {"1", "2", "3", "4"} and sum(s["tiers"].values()) == s["n_tasks"]
        assert len(s["examples"]) == 2 and all(e["id"] and e["instruction"] for e in s["examples"])


def test_info_text_and_unknown_name():
    res = runner.invoke(app, ["info", "terminal-hard"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "fix-sum-script" in res.stdout
    res = runner.invoke(app, ["info", "terminal-hardd"], env={"COLUMNS": "200"})
    assert res.exit_code == 2
    assert (
        "unknown environment 'terminal-hardd'" in res.stderr and "did you mean 'terminal-hard'" in res.stderr
    )


def test_eval_oracle_passes_and_reports_json():
    res = runner.invoke(
        app, ["eval", "terminal-hard", "--oracle", "--split", "test", "--json", "--concurrency", "2"]
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["pass_rate"] == 1.0 and report["failures"] == []
    assert report["n_total"] == 4 and {r["split"] for r in report["results"]} == {"test"}


def test_eval_oracle_lists_failures_and_exits_nonzero(wrong_env):
    res = runner.invoke(app, ["eval", wrong_env, "--oracle"], env={"COLUMNS": "200"})
    assert res.exit_code == 1, res.output
    assert "FAIL bad: file_equals a.txt: content is 'ho'" in res.stdout
    assert "pass rate 50.0% (1/2)" in res.stdout
    res = runner.invoke(app, ["eval", wrong_env, "--oracle", "--task", "good", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["n_total"] == 1


def test_eval_bad_arguments():
    assert runner.invoke(app, ["eval", "terminal-hard"]).exit_code == 2  # no --oracle
    res = runner.invoke(app, ["eval", "terminal-hard", "--oracle", "--split", "dev"])
    assert res.exit_code == 2 and "--split 'dev'" in res.stderr
    res = runner.invoke(app, ["eval", "terminal-hard", "--oracle", "--task", "nope"])
    assert res.exit_code == 2 and "nope" in res.stderr


def test_init_scaffolds_a_package(tmp_path):
    target = tmp_path / "pkg"
    res = runner.invoke(app, ["init", "my-tasks", "--dir", str(target)])
    assert res.exit_code == 0, res.output
    pyproject = (target / "pyproject.toml").read_text()
    assert 'my-tasks = "miles_env_my_tasks:MyTasksEnv"' in pyproject
    assert '[project.entry-points."miles_env.environments"]' in pyproject
    module = (target / "miles_env_my_tasks" / "__init__.py").read_text()
    assert "class MyTasksEnv(ChecksEnvironment)" in module and "$" not in module.replace("$(", "")
    assert "miles-env env eval my-tasks --oracle" in (target / "README.md").read_text()
    # refuses a non-empty directory and a bad name
    assert runner.invoke(app, ["init", "my-tasks", "--dir", str(target)]).exit_code == 2
    assert runner.invoke(app, ["init", "My_Tasks", "--dir", str(tmp_path / "x")]).exit_code == 2


def test_scaffolded_module_loads_and_its_oracle_passes(tmp_path, monkeypatch):
    runner.invoke(app, ["init", "demo-env", "--dir", str(tmp_path / "demo")])
    monkeypatch.syspath_prepend(str(tmp_path / "demo"))
    res = runner.invoke(app, ["eval", "miles_env_demo_env:DemoEnvEnv", "--oracle", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["n_passed"] == 2


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("miles-env")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "miles_env.cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_init_then_pip_install_shows_up_in_env_list(tmp_path):
    name = f"scaffold-{uuid.uuid4().hex[:8]}"
    target = tmp_path / name
    assert _cli("env", "init", name, "--dir", str(target)).returncode == 0
    pip = [sys.executable, "-m", "pip"]
    dist = f"miles-env-{name}"
    subprocess.run([*pip, "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(target)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    try:
        listed = _cli("env", "list", "--json")
        assert listed.returncode == 0, listed.stderr
        (entry,) = [e for e in json.loads(listed.stdout) if e["name"] == name]
        assert entry["source"] == f"{dist} 0.1.0" and entry["n_tasks"] == {"train": 1, "test": 1}
        oracle = _cli("env", "eval", name, "--oracle", "--json")
        assert oracle.returncode == 0, oracle.stdout + oracle.stderr
        assert json.loads(oracle.stdout)["pass_rate"] == 1.0
    finally:
        subprocess.run([*pip, "uninstall", "-y", "-q", dist], check=True, capture_output=True, timeout=120)
    assert name not in _cli("env", "list", "--json").stdout
