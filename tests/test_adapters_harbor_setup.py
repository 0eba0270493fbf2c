"""A Harbor task's Dockerfile: replayed in the local sandbox, or built for the docker provider."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest

from miles_env.adapters.harbor import HarborTasksEnvironment
from miles_env.adapters.harbor.dockerfile import base_image, parse_dockerfile, static_env
from miles_env.oracle import run_solution
from miles_env.registry import load_environment
from tests.harbor_support import SETUP_STEPS as EXAMPLE
from tests.harbor_support import copy_task


def oracle(task_dir: Path, provider: str = "local", solution: str | None = None):  # type: ignore[no-untyped-def]
    from miles_env.sandboxes import get_provider

    env = load_environment(f"harbor:{task_dir}")
    (task,) = env.tasks("test")
    return anyio.run(run_solution, env, task, get_provider(provider), solution)


def test_parse_dockerfile() -> None:
    steps = parse_dockerfile((EXAMPLE / "environment" / "Dockerfile").read_text())
    ops = [s.op for s in steps]
    assert ops == ["FROM", "ARG", "ENV", "ENV", "RUN", "WORKDIR", "COPY", "COPY", "RUN", "RUN", "CMD"]
    assert steps[2].line == 4 and steps[2].args.split() == ["APP_HOME=/app", "TOOLS=/app/tools"]
    assert "rm -rf /var/lib/apt/lists" in steps[4].args  # continuation joined
    assert base_image(steps) == "ubuntu:24.04"
    env = static_env(steps)
    assert env["APP_HOME"] == "/app" and env["PATH"].startswith("/app/tools:/usr/local/sbin:")
    assert base_image(parse_dockerfile("FROM a AS build\nRUN x\nFROM --platform=x b:1\n")) == "b:1"


def test_task_spec_from_dockerfile() -> None:
    (task,) = HarborTasksEnvironment(EXAMPLE).tasks("test")
    assert task.sandbox.workdir == "/app" and task.sandbox.env["APP_HOME"] == "/app"
    assert task.sandbox.files == {}  # COPY happens in the setup phase, in Dockerfile order


def test_local_setup_runs_the_steps() -> None:
    """RUN (shell and exec form), ENV, ARG, WORKDIR, COPY replayed; the oracle then passes."""
    res = oracle(EXAMPLE)
    assert res.error is None, res.error
    assert res.score == 1.0, res.details


def test_local_setup_steps_matter(tmp_path: Path) -> None:
    """Without the RUN that writes build/greeting.txt the same solution fails: the steps really ran."""
    df = (EXAMPLE / "environment" / "Dockerfile").read_text()
    d = copy_task(tmp_path, df.replace('echo "$GREETING from $APP_HOME"', 'echo "bye"'))
    res = oracle(d)
    assert res.error is None and res.score == 0.0


def test_nop_scores_zero() -> None:
    res = oracle(EXAMPLE, solution="true")
    assert res.error is None and res.score == 0.0


@pytest.mark.parametrize(
    ("line", "expect"),
    [
        ("RUN apt-get update && apt-get install -y miles-env-no-such-pkg", "line 3: RUN apt-get update"),
        ("RUN useradd -m agent", "needs root or a package index (useradd)"),
        ("RUN test -f /nonexistent", "line 3: RUN test -f /nonexistent: exit code 1"),
        ("COPY data/words.txt /etc/words.txt", "line 3: COPY data/words.txt /etc/words.txt: cannot write"),
        ("COPY --from=builder /x /app/x", "COPY --from needs a docker build"),
    ],
)
def test_local_setup_fails_naming_the_step(tmp_path: Path, line: str, expect: str) -> None:
    d = copy_task(tmp_path, f"FROM ubuntu:24.04\nWORKDIR /app\n{line}\nRUN touch /app/after\n")
    res = oracle(d)
    assert res.error is not None and expect in res.error, res.error
    assert "setup_steps" in res.error  # the task is named too


def _docker_base() -> str | None:
    try:
        import docker

        client = docker.from_env(timeout=5)
        client.ping()
    except Exception:
        return None
    from miles_env.sandboxes.docker import DEFAULT_IMAGE

    for image in (DEFAULT_IMAGE, "ubuntu:24.04", "debian:bookworm-slim", "busybox:latest"):
        try:
            client.images.get(image)
            return image
        except Exception:
            continue
    return None


@pytest.mark.slow
def test_docker_provider_builds_the_dockerfile(tmp_path: Path) -> None:
    """On the docker provider the Dockerfile is built for real (offline), root steps included."""
    base = _docker_base()
    if base is None:
        pytest.skip("no docker daemon with a usable base image available locally")
    df = (EXAMPLE / "environment" / "Dockerfile").read_text().replace("ubuntu:24.04", base)
    # Offline, a local base image has no package index: drop the apt-get step (the replay skips it
    # because bash and coreutils are installed; a real build would have to reach the mirror).
    df = re.sub(r"RUN apt-get .*?lists/\*\n", "", df, flags=re.S)
    assert "apt-get" not in df
    # A step only a real build can run (root), with no network: it must not fail the episode.
    df = df.replace("CMD [", "RUN mkdir -p /opt/built && touch /opt/built/marker\nCMD [")
    d = copy_task(tmp_path, df)
    (d / "tests" / "test.sh").write_text(
        (d / "tests" / "test.sh")
        .read_text()
        .replace('&& [ "$APP_HOME" = /app ]', "&& [ -f /opt/built/marker ]")
    )
    res = oracle(d, provider="docker")
    assert res.error is None, res.error
    assert res.score == 1.0, res.details
    assert oracle(d, provider="local").error is not None  # /opt is not writable without a build


@pytest.mark.slow
def test_docker_build_failure_fails_the_episode_with_the_log(tmp_path: Path) -> None:
    base = _docker_base()
    if base is None:
        pytest.skip("no docker daemon with a usable base image available locally")
    d = copy_task(tmp_path, f"FROM {base}\nRUN echo building-step-fails >&2; exit 3\n")
    res = oracle(d, provider="docker")
    assert res.error is not None and "docker build" in res.error and "building-step-fails" in res.error, (
        res.error
    )


def test_local_runs_build_nothing(tmp_path: Path) -> None:
    """The spec names the build context; the local provider ignores it and the steps are replayed."""
    env = HarborTasksEnvironment(EXAMPLE.parent)
    task = next(t for t in env.tasks() if t.id == "setup_steps")
    spec = env.sandbox_spec(task)
    assert spec.build == str(EXAMPLE / "environment") and spec.image is None
    res = oracle(EXAMPLE)
    assert res.error is None and res.score == 1.0, res
