"""The venv manager and the adapters CLI, without installing anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from miles_env.adapters import venv
from miles_env.adapters.venv import FrameworkSpec, NoSuitablePython, find_python
from typer.testing import CliRunner

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
    }
    (d / venv.MARKER).write_text(json.dumps(marker))
    (info,) = venv.installed()
    assert info.name == "openenv" and info.reused
    assert venv.install("openenv") == info  # a present marker with the same pin is a no-op
    res = CliRunner().invoke(app, ["adapters", "list"])
    assert res.exit_code == 0 and "openenv    installed (openenv-core==0.3.0" in res.output
    assert "verifiers  not installed" in res.output


def test_cli_unknown_adapter() -> None:
    res = CliRunner().invoke(app, ["adapters", "install", "gymnasium"])
    assert res.exit_code == 2
    assert (
        "adapter 'gymnasium' is unknown; known adapters: harbor, hud, nemo-gym, openenv, verifiers"
        in res.output
    )
