"""The CLI's error edge: a known failure is one line on stderr and exit code 2, never a traceback.

Each case runs `miles-env` in a subprocess, as a user would; a missing optional package is
simulated by poisoning `sys.modules` before the CLI starts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

MAIN = "import sys; from miles_env.cli.main import main; sys.argv[0] = 'miles-env'; main()"
NO_DOCKER = "import sys; sys.modules['docker'] = None; " + MAIN.removeprefix("import sys; ")


def run_cli(*args: str, code: str = MAIN, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def assert_one_line(res: subprocess.CompletedProcess[str], *names: str) -> str:
    err = res.stderr
    assert res.returncode == 2, (res.returncode, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for name in names:
        assert name in err, err
    return err


def test_missing_optional_package_names_it_and_its_extra() -> None:
    res = run_cli("sandbox", "exec", "--sandbox", "docker", "--", "true", code=NO_DOCKER)
    err = assert_one_line(res, "docker")
    assert "miles-env[docker]" in err


def test_queue_stats_on_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    db = tmp_path / "queue.db"
    db.write_text("these bytes are not an SQLite database header, nor anything like one\n" * 20)
    assert_one_line(run_cli("queue", "stats", str(db)), str(db), "not a database")


def test_proxy_serve_with_a_missing_model_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    res = run_cli("proxy", "serve", "--port", "0", "--store", str(tmp_path / "s"), "--model", str(missing))
    assert_one_line(res, str(missing), "does not exist")


@pytest.mark.parametrize(("port", "says"), [("99999", "65535"), ("-1", "0"), ("http", "integer")])
def test_proxy_serve_with_a_bad_port(tmp_path: Path, port: str, says: str) -> None:
    res = run_cli("proxy", "serve", "--port", port, "--store", str(tmp_path / "s"), "--engine", "scripted")
    assert_one_line(res, "--port", says)


def test_bad_config_file_is_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text("trainer: [\n")
    assert_one_line(run_cli("train", str(cfg)), str(cfg), "yaml")
    assert_one_line(run_cli("train", str(tmp_path / "absent.yaml")), "absent.yaml")


def test_a_bad_key_in_a_component_section_is_named_at_load(tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text("engine:\n  kind: hf\n  kv_cache_tokns: 1\n")
    assert_one_line(
        run_cli("train", str(cfg)), "engine.kv_cache_tokns: Extra inputs are not permitted (kind hf)"
    )
    res = run_cli("train", str(cfg), "--set", "engine.kind=sglang", "--set", "sandbox.provider=lxc")
    assert_one_line(
        res, "engine.kv_cache_tokns", "(kind sglang)", "sandbox.provider: 'lxc' is unknown; known:"
    )
    res = run_cli("eval", "--env", "terminal-basics", "--harness", "codex", "--max-turns", "2")
    assert_one_line(res, "harness.max_turns: Extra inputs are not permitted (name codex)")
    opts = (
        "--port",
        "0",
        "--store",
        str(tmp_path / "s"),
        "--engine",
        "scripted",
        "--engine-opt",
        "kv_cache_gb=2",
    )
    assert_one_line(run_cli("proxy", "serve", *opts), "engine.kv_cache_gb: Extra inputs are not permitted")


def test_usage_error_is_one_line() -> None:
    assert_one_line(run_cli("queue", "stats"), "Missing argument", "--help")


def test_help_still_prints_help() -> None:
    res = run_cli("queue")  # no_args_is_help: the group's help, not an error line
    assert "stats" in res.stdout + res.stderr and "Traceback" not in res.stderr
    assert run_cli("--help").returncode == 0
