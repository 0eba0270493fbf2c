"""`miles-env doctor`: all ok on a set-up machine; a hidden binary or module is named with its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_env.config import load_config
from miles_env.doctor import needs

REPO = Path(__file__).resolve().parents[1]


def _doctor(
    *args: str, pre: str = "pass", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    code = f"import sys; {pre}; from miles_env.cli.main import main; sys.argv = ['miles-env', 'doctor', *sys.argv[1:]]; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, cwd=REPO, env=env
    )


def _lines(out: str) -> dict[str, str]:
    return {line.split()[1]: line for line in out.splitlines() if line and not line.startswith("doctor:")}


def test_default_config_all_ok_after_setup():
    r = _doctor("--config", "examples/terminal-cpu.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all that this config needs is here" in r.stdout
    for name in ("python", "torch", "bubblewrap", "default"):
        assert _lines(r.stdout)[name].startswith("ok"), r.stdout


def test_what_a_config_needs():
    base = load_config(REPO / "examples/terminal-cpu.yaml")
    assert {"python", "torch", "bubblewrap", "pids cgroup", "default model"} <= needs(base)
    assert "docker" not in needs(base) and "claude-code" not in needs(base)
    heavy = load_config(
        None,
        [
            "sandbox.provider=docker",
            "harness.name=claude-code",
            "engine.kind=vllm",
            "trainer.backend=megatron",
            "env=harbor:hello",
        ],
    )
    assert {"docker", "node/npm", "claude-code", "vllm venv", "megatron-core", "adapter harbor"} <= needs(
        heavy
    )
    assert "bubblewrap" not in needs(heavy)
    assert "e2b credentials" in needs(load_config(None, ["sandbox.provider=e2b"]))


def test_hidden_binary_is_named_with_its_fix(tmp_path):
    # A PATH without node or npm: the claude-code harness cannot run, doctor says so and fails.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(sys.executable, bindir / "python3")
    env = {**os.environ, "PATH": str(bindir)}
    r = _doctor("--set", "harness.name=claude-code", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    line = _lines(r.stdout)["node/npm"]
    assert line.startswith("MISSING") and "apt-get install nodejs npm" in line
    # the summary counts every MISSING line (the CLI itself is missing too where it is not installed)
    missing = sum(1 for line in r.stdout.splitlines() if line.startswith("MISSING"))
    assert f"doctor: {missing} missing of what this config needs" in r.stdout


def test_hidden_module_is_named_with_its_fix():
    r = _doctor("--set", "trainer.backend=megatron", pre="sys.modules['megatron'] = None")
    assert r.returncode == 1, r.stdout + r.stderr
    line = _lines(r.stdout)["megatron-core"]
    assert line.startswith("MISSING") and "[megatron] extra" in line
    # Not needed by the default config: shown, but the exit code stays 0.
    r = _doctor(pre="sys.modules['megatron'] = None")
    assert r.returncode == 0 and _lines(r.stdout)["megatron-core"].startswith("-")


def test_credentials_are_never_printed():
    secret = "sk-do-not-print-1234"
    r = _doctor("--json", env={**os.environ, "E2B_API_KEY": secret})
    assert secret not in r.stdout + r.stderr
    row = next(c for c in json.loads(r.stdout) if c["name"] == "e2b credentials")
    assert row["ok"] and "E2B_API_KEY" in row["detail"]


@pytest.mark.parametrize("name", ["claude-code", "codex"])
def test_cli_check_points_at_install_script(name, tmp_path):
    r = _doctor("--json", env={**os.environ, "MILES_ENV_CACHE": str(tmp_path)})
    row = next(c for c in json.loads(r.stdout) if c["name"] == name)
    assert not row["ok"] and row["fix"] == f"scripts/install-clis.sh {name}"
