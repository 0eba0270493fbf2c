"""A Harbor task's Dockerfile is built by the provider's real builder (no replay): the local
provider's buildah build, its root filesystem the sandbox's; a failing step fails the episode
with the build's log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from miles_env.adapters.harbor import HarborTasksEnvironment
from miles_env.oracle import run_solution
from miles_env.registry import load_environment
from tests.harbor_support import SETUP_STEPS as EXAMPLE
from tests.harbor_support import copy_task


def oracle(task_dir: Path, provider: str = "local", solution: str | None = None):  # type: ignore[no-untyped-def]
    from miles_env.sandboxes import get_provider

    env = load_environment(f"harbor:{task_dir}")
    (task,) = env.tasks("test")
    return anyio.run(run_solution, env, task, get_provider(provider), solution)


def test_task_spec_from_dockerfile() -> None:
    env = HarborTasksEnvironment(EXAMPLE)
    (task,) = env.tasks("test")
    assert task.sandbox.workdir == "/app" and task.sandbox.files == {}
    assert env.sandbox_spec(task).build == str(EXAMPLE / "environment")  # its tests install nothing
    assert HarborTasksEnvironment(EXAMPLE, hermetic=False).sandbox_spec(task).build == str(
        EXAMPLE / "environment"
    )


def test_the_dockerfile_is_built_and_its_steps_matter(image_bases: Any) -> None:
    """ARG, ENV (PATH), apt-get in RUN, WORKDIR, COPY, exec-form RUN: built, then oracle 1, nop 0."""
    res = oracle(EXAMPLE)
    assert res.error is None and res.score == 1.0, (res.error, res.details)
    res = oracle(EXAMPLE, solution="true")
    assert res.error is None and res.score == 0.0


def test_a_failing_build_step_fails_the_episode_with_its_log(tmp_path: Path, image_bases: Any) -> None:
    d = copy_task(tmp_path, "FROM debian:trixie\nRUN echo building-step-fails >&2; exit 3\n")
    res = oracle(d)
    assert res.error is not None and "building-step-fails" in res.error, res.error
