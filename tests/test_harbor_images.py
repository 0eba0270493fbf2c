"""Tasks in the shapes of public Terminal-Bench 2 tasks, on real images, on local and docker.

Each task (tests/harbor_support.make_world_tasks) builds `FROM ubuntu:24.04` through the
session's bootstrapped Debian bases (the alias table's trixie substitute), with apt-get and pip
installs in RUN, a non-root USER, and the stock TB 2.x verifier (apt-get install curl, astral's
uv installer, `uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5`): hermetic verification
provisions those at build time and every sandbox runs with no network (`--network none`). The
four tasks share one environment, so each provider builds one image for all of them. `env
validate` must pass: oracle 1, do-nothing 0, three equal verifies, for every task.

One end-to-end test per provider (each builds its image once, the bulk of its time); the
sidecar test reuses the docker build and adds a tiny sidecar image.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from miles_env.validate import validate_env
from tests.harbor_support import make_sidecar_task, make_world_tasks


@pytest.fixture(scope="module")
def docker_engine() -> str:
    """A real dockerd (scripts/start-dockerd.sh); skip (a failure under CI=true) when impossible."""
    from tests.images_support import docker_ready

    why = docker_ready()
    if why is not None:
        pytest.skip(f"docker engine unavailable: {why}")
    return "unix:///var/run/docker.sock"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, image_bases: Any) -> Path:
    return make_world_tasks(tmp_path_factory.mktemp("world"))


def _passes(path: Path, provider: str) -> None:
    report = validate_env(str(path), provider=provider, quick=True, network="none")
    assert report.passed, report.render()


def test_world_shaped_tasks_pass_on_local(world: Path) -> None:
    _passes(world, "local")


def test_world_shaped_tasks_pass_on_docker(world: Path, docker_engine: str) -> None:
    _passes(world, "docker")


def test_a_compose_sidecar_is_reached_by_its_name_on_docker(
    tmp_path: Path, world: Path, docker_engine: str
) -> None:
    _passes(make_sidecar_task(tmp_path), "docker")
