"""Tasks in the shapes of public Terminal-Bench 2 tasks, on real images, on local and docker.

Each task (tests/harbor_support.make_world_tasks) builds `FROM ubuntu:24.04` through the
session's bootstrapped bases (the alias table's Ubuntu noble, from the Ubuntu archive), with
apt-get and pip installs in RUN, a non-root USER, and the stock TB 2.x verifier (apt-get install
curl, astral's uv installer, `uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5`: noble has
no 3.13, so Debian trixie's, adapters/harbor/pythons.py): hermetic verification provisions those
at build time and every sandbox runs with no network (`--network none`). The
four tasks share one environment, so each provider builds one image for all of them. `env
validate` must pass: oracle 1, do-nothing 0, three equal verifies, for every task.

One end-to-end test per provider (each builds its image once, the bulk of its time); the
sidecar test reuses the docker build and adds a tiny sidecar image (the Harbor wiring, which is the
same for every provider that runs sidecars). On local, a python http server built from its own
context runs as a sidecar beside a plain sandbox: reached by its service name, apart from the task
sandbox but for the network, and gone (processes and files) once it is closed. A small task per
provider runs its agent and its verifier as the users task.toml names.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest

from miles_env.adapters.harbor import HarborTasksEnvironment
from miles_env.oracle import run_solution
from miles_env.sandboxes import get_provider
from miles_env.validate import validate_env
from tests.harbor_support import (
    DOCKERFILE,
    TEST_SH,
    make_older_glibc_task,
    make_sidecar_task,
    make_task,
    make_world_tasks,
)


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


@pytest.mark.parametrize("provider", ["local", "docker"])
def test_the_agent_and_the_verifier_run_as_their_users(
    tmp_path: Path, provider: str, image_bases: Any, request: pytest.FixtureRequest
) -> None:
    """Harbor's `[agent] user` (the built image's USER: the oracle's files are the agent's) and
    `[verifier] user` (test.sh as nobody, `docker exec -u`), on both providers; the tests, uploaded
    by the image's own user (root), are not the agent's to change."""
    if provider == "docker":
        request.getfixturevalue("docker_engine")
    d = make_task(tmp_path, "as-users", dockerfile=DOCKERFILE + "RUN chown ubuntu /app\n")
    toml = d / "task.toml"
    toml.write_text(
        toml.read_text()
        .replace("[agent]\n", '[agent]\nuser = "ubuntu"\n')
        .replace("[verifier]\n", '[verifier]\nuser = "nobody"\n')
    )
    checks = '[ "$(id -un)" = nobody ] && [ "$(stat -c %U /app/out/hello.txt)" = ubuntu ] && '
    checks += '[ "$(stat -c %U "$(dirname "$0")")" = root ] && '
    (d / "tests" / "test.sh").write_text(TEST_SH.replace('if [ "$(', f'if {checks}[ "$(', 1))
    env = HarborTasksEnvironment(tmp_path)
    (task,) = env.tasks("test")
    assert Path(str(env.sandbox_spec(task).build), "Dockerfile").read_text().endswith("\nUSER ubuntu\n")
    for solution, want in ((None, 1.0), ("true", 0.0)):
        res = anyio.run(run_solution, env, task, get_provider(provider), solution)
        assert res.error is None and res.score == want, (solution, res.details)


def test_the_verifiers_python_runs_where_its_distribution_cannot(tmp_path: Path, image_bases: Any) -> None:
    """`uvx -p 3.12` on bookworm (glibc 2.36): the portable CPython from Ubuntu noble's packages
    (adapters/harbor/pythons.py), offline at verify time; on local (docker places it the same way:
    the same context and install script)."""
    _passes(make_older_glibc_task(tmp_path), "local")


def test_a_compose_sidecar_is_reached_by_its_name_on_docker(
    tmp_path: Path, world: Path, docker_engine: str
) -> None:
    _passes(make_sidecar_task(tmp_path), "docker")


def _procs(tag: str) -> list[str]:
    return subprocess.run(["pgrep", "-af", tag], capture_output=True, text=True).stdout.splitlines()


def test_a_local_sidecar_shares_only_the_network_and_goes_with_its_sandbox(
    tmp_path: Path, image_bases: Any
) -> None:
    from miles_env.errors import SandboxError
    from miles_env.sandboxes.local import LocalSandboxProvider
    from miles_env.sandboxes.local.config import LocalSandboxConfig
    from miles_env.types import SandboxSpec
    from tests.images_support import images_config

    tag = "miles-env-test-sidecar-web"  # in its CMD, so its processes can be found on the host
    server = (
        "import http.server as h; h.ThreadingHTTPServer(('127.0.0.1', 8000), h.SimpleHTTPRequestHandler)"
        f".serve_forever()  # {tag}"
    )
    context = tmp_path / "web"  # built from its own context, its command the image's CMD
    context.mkdir()
    (context / "Dockerfile").write_text(
        f"FROM python:3.12-slim\nCMD {json.dumps(['python3', '-c', server])}\n"
    )
    probe = "import socket; socket.create_connection(('localhost', 8000), timeout=2)"
    get = "import urllib.request as u; print(u.urlopen('http://web:8000/').status)"
    root = tmp_path / "sandboxes"

    async def main() -> tuple[str, list[str], int, str]:
        provider = LocalSandboxProvider(LocalSandboxConfig(root_dir=str(root), images=images_config()))
        try:
            async with await provider.create(SandboxSpec()) as sb:
                await sb.start_sidecar("web", build=str(context), healthcheck=["CMD", "python3", "-c", probe])
                bad = "sh -c 'echo boom; exit 3'"  # a string: split as compose splits it
                with pytest.raises(SandboxError, match=r"sidecar 'bad' exited \(3\): boom"):
                    await sb.start_sidecar("bad", image="python:3.12-slim", command=bad, healthcheck="false")
                every_cmdline = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"
                r = await sb.exec(f"python3 -c {get!r} && {every_cmdline}")
                running, dirs = _procs(tag), len(list(root.iterdir()))
            return r.stdout, running, dirs, r.stderr
        finally:
            await provider.aclose()

    out, running, dirs, err = anyio.run(main)
    assert out.splitlines()[0] == "200", (out, err)  # by its name, through the shared loopback
    assert tag not in out  # its processes are not in the task sandbox's pid namespace
    assert len(running) == 1 and dirs == 3  # the task sandbox, the sidecar, the failed one (until close)
    assert _procs(tag) == [] and list(root.iterdir()) == []  # closed with it: processes and files
