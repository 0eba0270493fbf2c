"""The venv manager and the adapters CLI, installing nothing from an index (a wheel built in the test)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from miles_env.adapters import venv
from miles_env.adapters.venv import FrameworkSpec, NoSuitablePython, find_python
from miles_env.cli.main import app


def test_no_suitable_python_is_a_clear_error() -> None:
    spec = FrameworkSpec("future", ("future-pkg==1.0",), min_python=(3, 99))
    with pytest.raises(NoSuitablePython, match=r"adapter 'future' needs Python >= 3.99; found: .*\(3\.\d+\)"):
        find_python(spec)


def test_python_range_is_respected() -> None:
    exe, ver = find_python(FrameworkSpec("x", (), min_python=(3, 11), max_python=(3, 13)))
    assert (3, 11) <= ver < (3, 13) and Path(exe).exists()


def test_cache_dir_and_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_ENV_CACHE", str(tmp_path))
    assert venv.cache_root() == tmp_path / "adapters"
    assert venv.installed() == []
    d = tmp_path / "adapters" / "openenv"
    d.mkdir(parents=True)
    marker = {
        "name": "openenv",
        "path": str(d),
        "python": "/x/python3.12",
        "python_version": "3.12",
        "packages": ["openenv-core==0.3.0", "websockets"],
        "installed_at": 1.0,
        "seconds": 2.0,
        "lock": hashlib.sha256(venv.lock_file("openenv").read_bytes()).hexdigest(),  # type: ignore[union-attr]
    }
    (d / venv.MARKER).write_text(json.dumps(marker))
    (info,) = venv.installed()
    assert info.name == "openenv" and info.reused
    assert venv.install("openenv") == info  # a present marker with the same pin and lock is a no-op
    res = CliRunner().invoke(app, ["adapters", "list"])
    assert res.exit_code == 0 and "openenv    installed (openenv-core==0.3.0" in res.output
    assert "verifiers  not installed" in res.output


def test_a_changed_lock_reinstalls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_ENV_CACHE", str(tmp_path))
    d = tmp_path / "adapters" / "openenv"
    d.mkdir(parents=True)
    marker = {"name": "openenv", "path": str(d), "python": "p", "python_version": "3.12", "installed_at": 1.0}
    marker |= {
        "packages": ["openenv-core==0.3.0", "websockets"],
        "lock": "0" * 64,
    }  # installed under another lock

    class Reinstalling(Exception):
        pass

    def refuse(spec: FrameworkSpec) -> None:
        raise Reinstalling(spec.name)

    (d / venv.MARKER).write_text(json.dumps(marker))
    monkeypatch.setattr(venv, "find_python", refuse)
    with pytest.raises(Reinstalling):
        venv.install("openenv")
    monkeypatch.setenv("MILES_ENV_LOCK", "none")  # re-locking: resolve freely, lock digest ""
    assert venv.lock_file("openenv") is None


def test_cli_unknown_adapter() -> None:
    res = CliRunner().invoke(app, ["adapters", "install", "gymnasium"])
    assert res.exit_code == 2
    assert (
        "adapter 'gymnasium' is unknown; known adapters: harbor, hud, nemo-gym, openenv, verifiers"
        in res.output
    )


def _marker(d: Path, name: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    info = {"name": name, "path": str(d), "python": "/x/python3.13", "python_version": "3.13"}
    info |= {"packages": [f"{name}==1"], "installed_at": 1.0, "seconds": 1.0}
    (d / venv.MARKER).write_text(json.dumps(info))


def _fake_venvs(root: Path) -> None:
    """Two 'installed' framework venvs as files only (no interpreter: discovery must not start one)."""
    vf = root / "adapters" / "verifiers"
    _marker(vf, "verifiers")
    site = vf / "lib" / "python3.13" / "site-packages"
    for dist, requires, top in [
        ("my_env-0.1", "Requires-Dist: Verifiers>=0.4; extra == 'x'", "my_env"),
        ("other-2.0", "Requires-Dist: verifiers-extra==1", "other"),
    ]:
        (site / f"{dist}.dist-info").mkdir(parents=True)
        (site / f"{dist}.dist-info" / "METADATA").write_text(f"Name: {dist}\n{requires}\n")
        (site / f"{dist}.dist-info" / "top_level.txt").write_text(top + "\n")
    ng = root / "adapters" / "nemo-gym"
    _marker(ng, "nemo-gym")
    servers = ng / "lib" / "python3.12" / "site-packages" / "resources_servers"
    (servers / "foo" / "data").mkdir(parents=True)
    (servers / "foo" / "app.py").write_text("")
    (servers / "foo" / "data" / "example.jsonl").write_text('{"a": 1}\n{"a": 2}\n\n{"a": 3}\n')
    (servers / "bar").mkdir()
    (servers / "bar" / "app.py").write_text("")  # no example data: not listed


def test_env_list_shows_installed_adapter_envs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from miles_env.adapters.counts import cached_counts, remember_counts
    from miles_env.adapters.discover import EXAMPLES_DIR
    from miles_env.registry import list_environments

    monkeypatch.setenv("MILES_ENV_CACHE", str(tmp_path))
    _fake_venvs(tmp_path)
    example = f"verifiers:{EXAMPLES_DIR / 'vf_say_word.py'}"
    by_name = {i.name: i for i in list_environments() if i.source.startswith("adapter:")}
    assert sorted(by_name) == sorted([example, "verifiers:my_env", "nemo-gym:foo"])
    assert by_name["nemo-gym:foo"].source == "adapter:nemo-gym"
    assert by_name["nemo-gym:foo"].n_tasks == {"test": 3}  # counted from the data file
    assert by_name["verifiers:my_env"].n_tasks == {}  # not counted yet: that needs a worker
    remember_counts("verifiers:my_env", {"test": 7})  # what the env's tasks() records
    assert cached_counts("verifiers:my_env") == {"test": 7}
    res = CliRunner().invoke(app, ["env", "list", "--json"])
    assert res.exit_code == 0, res.output
    listed = {e["name"]: e for e in json.loads(res.stdout)}
    assert listed["verifiers:my_env"] == {
        "name": "verifiers:my_env",
        "source": "adapter:verifiers",
        "description": "verifiers environment package my_env",
        "n_tasks": {"test": 7},
        "error": None,
    }
    assert "terminal-basics" in listed  # the installed native environments are still there
    res = CliRunner().invoke(app, ["env", "list", "--json", "--no-adapters"])
    assert not any(e["source"].startswith("adapter:") for e in json.loads(res.stdout))
    marker = tmp_path / "adapters" / "verifiers" / venv.MARKER
    os.utime(marker, ns=(1, 1))  # a reinstall: the cached count is stale
    assert cached_counts("verifiers:my_env") == {}


def test_env_list_shows_broken_verifiers_envs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a package that cannot load on the installed verifiers was listed as fine (or not at all)."""
    from miles_env.registry import list_environments

    monkeypatch.setenv("MILES_ENV_CACHE", str(tmp_path))
    _fake_venvs(tmp_path)
    site = tmp_path / "adapters" / "verifiers" / "lib" / "python3.13" / "site-packages"
    (site / "verifiers-0.4.0.dist-info").mkdir()
    for dist, requires, source in [
        ("new_env-1.0", "verifiers>=0.5", "from verifiers.v1 import Taskset\n"),
        (
            "old_env-0.3",
            "verifiers",
            "import verifiers as vf\ndef load_environment(**kw):\n    return vf.Environment()\n",
        ),
        ("ok_env-1.0", "verifiers>=0.4,<0.5", "from verifiers.v1 import Taskset\n__all__ = ['T']\n"),
    ]:
        name = dist.split("-")[0]
        (site / f"{dist}.dist-info").mkdir()
        (site / f"{dist}.dist-info" / "METADATA").write_text(f"Name: {name}\nRequires-Dist: {requires}\n")
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(source)
    by_name = {i.name: i for i in list_environments() if i.source == "adapter:verifiers"}
    assert by_name["verifiers:new_env"].error == "requires verifiers>=0.5 (installed 0.4.0)"
    assert by_name["verifiers:old_env"].error == (
        "exports no verifiers.v1 Taskset (it defines load_environment(), the older verifiers API)"
    )
    assert by_name["verifiers:ok_env"].error is None
    res = CliRunner().invoke(app, ["env", "list"])
    assert res.exit_code == 0, res.output
    assert "verifiers:new_env: requires verifiers>=0.5 (installed 0.4.0)" in " ".join(res.output.split())


def _tiny_wheel(tmp: Path) -> Path:
    """A pure wheel built here (no index needed): `tinypkg` 1.0 with VALUE = 7."""
    files = {
        "tinypkg/__init__.py": "VALUE = 7\n",
        "tinypkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def row(name: str, data: str) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data.encode()).digest()).rstrip(b"=").decode()
        return f"{name},sha256={digest},{len(data.encode())}\n"

    record = "".join(row(n, d) for n, d in files.items()) + "tinypkg-1.0.dist-info/RECORD,,\n"
    whl = tmp / "tinypkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("tinypkg-1.0.dist-info/RECORD", record)
    return whl


def _imports_tinypkg(target: Path) -> bool:
    r = subprocess.run([str(target / "bin" / "python"), "-c", "import tinypkg; print(tinypkg.VALUE)"],
                       capture_output=True, text=True)  # fmt: skip
    return r.returncode == 0 and r.stdout.strip() == "7"


def test_venvs_are_built_by_uv_from_the_lock(tmp_path: Path) -> None:
    """uv (requirements.lock) builds the venv: no pip inside it, the package importable."""
    assert venv._uv(), "uv is in requirements.lock: setup.sh installs it"
    target = tmp_path / "v"
    venv._create(sys.executable, target, (), (str(_tiny_wheel(tmp_path)),), 300)
    assert _imports_tinypkg(target) and not (target / "bin" / "pip").exists()
    # byte-compiled at install: with PYTHONDONTWRITEBYTECODE=1 or a read-only venv no import writes one
    assert list(target.glob("lib/python3*/site-packages/tinypkg/__pycache__/__init__.*.pyc"))


def test_where_uv_fails_pip_installs_and_a_warning_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(venv, "_uv", lambda: "/bin/false")  # a uv that cannot install (a pip-only mirror)
    target = tmp_path / "v"
    venv._create(sys.executable, target, (), (str(_tiny_wheel(tmp_path)),), 300)
    assert _imports_tinypkg(target) and (target / "bin" / "pip").exists()
    assert "installing with pip instead" in capsys.readouterr().err
