"""Harbor's task format as the pinned harbor (0.26) defines it, on the real local sandbox: multi-step
tasks, the env sections and workdir, Harbor's defaults, a directory with malformed tasks, and what
`env validate` shows for a failing task."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from miles_env.adapters.harbor import HarborTasksEnvironment
from miles_env.adapters.harbor.hermetic import verifier_needs
from miles_env.errors import TaskError
from miles_env.oracle import run_solution
from miles_env.types import NetworkPolicy
from miles_env.validate import validate_env
from tests.harbor_support import TEST_SH, _write, make_env_task, make_steps_task, make_task

# The tasks build FROM ubuntu:24.04 / python:3.x-slim: the Debian bases they alias to (a lookup in CI).
pytestmark = pytest.mark.usefixtures("image_bases")


def _oracle(env: HarborTasksEnvironment, solution: str | None = None):  # type: ignore[no-untyped-def]
    from miles_env.sandboxes import get_provider

    (task,) = env.tasks("test")
    return anyio.run(run_solution, env, task, get_provider("local"), solution)


def test_multi_step_task_runs_each_step_in_order(tmp_path: Path) -> None:
    env = HarborTasksEnvironment(make_steps_task(tmp_path))
    (task,) = env.tasks("test")
    steps = env.step_tasks(task)
    assert [s.instruction for s in steps] == [
        "Write 'one' to /app/notes.txt.",
        "Append the word in /app/extra.cfg to /app/notes.txt.",
        "Write 'clean' to /app/audit.txt if no test file is in sight.",
    ]
    assert task.instruction == steps[0].instruction
    assert [s.sandbox.resources.agent_timeout_s for s in steps] == [40.0, 20.0, 40.0]
    assert task.sandbox.resources.agent_timeout_s == 100.0  # the episode's agent time: every step's
    res = _oracle(env)
    assert res.error is None and res.score == 1.0, res
    assert res.details["steps"] == {
        "write": {"reward": 1.0},
        "extend": {"reward": 1.0},
        "audit": {"reward": 1.0},
    }


def test_a_step_below_its_min_reward_ends_the_episode(tmp_path: Path) -> None:
    env = HarborTasksEnvironment(make_steps_task(tmp_path))
    res = _oracle(env, "true")  # a do-nothing agent: step `write` scores 0 under its min_reward 1
    assert res.score == 0.0 and res.details["steps"] == {"write": {"reward": 0.0}}
    # without the gate, the later steps run; the mean counts each verified step (audit passes)
    d = make_steps_task(tmp_path, "nogate")
    (d / "task.toml").write_text((d / "task.toml").read_text().replace("min_reward = 1.0\n", ""))
    res = _oracle(HarborTasksEnvironment(d), "echo clean > /app/audit.txt")
    assert res.details["steps"] == {
        "write": {"reward": 0.0},
        "extend": {"reward": 0.0},
        "audit": {"reward": 1.0},
    }
    assert res.score == pytest.approx(1 / 3)
    final = make_steps_task(tmp_path, "final", strategy="final")
    (final / "task.toml").write_text((final / "task.toml").read_text().replace("min_reward = 1.0\n", ""))
    assert _oracle(HarborTasksEnvironment(final), "echo clean > /app/audit.txt").score == 1.0


def test_env_sections_and_workdir_reach_their_phase(tmp_path: Path) -> None:
    env = HarborTasksEnvironment(make_env_task(tmp_path))
    (task,) = env.tasks("test")
    assert task.sandbox.workdir == "/srv/work" and task.sandbox.env["SHARED"] == "everywhere"
    assert task.verifier["env"] == {"VERDICT": "from-default"}
    res = _oracle(env)
    assert res.error is None and res.score == 1.0, res.details
    assert _oracle(env, "true").score == 0.0


def test_harbor_defaults_and_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = make_task(tmp_path)
    (d / "task.toml").write_text('version = "1.0"\n')
    (task,) = HarborTasksEnvironment(d).tasks("test")
    assert task.verifier["timeout_s"] == 600.0 and task.sandbox.resources.verifier_timeout_s == 600.0
    assert task.sandbox.network is NetworkPolicy.NONE  # asked for nothing: offline, our default
    for line, policy in (("allow_internet = true", "public"), ('network_mode = "public"', "public"),
                         ('network_mode = "no-network"', "none"), ("allow_internet = false", "none")):  # fmt: skip
        (d / "task.toml").write_text(f"[environment]\n{line}\n")
        (task,) = HarborTasksEnvironment(d).tasks("test")
        assert task.sandbox.network is NetworkPolicy(policy), line
    (d / "task.toml").write_text('[verifier.env]\nKEY = "${MILES_TEST_UNSET_VAR}"\n')
    monkeypatch.delenv("MILES_TEST_UNSET_VAR", raising=False)
    with pytest.raises(Exception, match=r"\[verifier.env\]\.KEY: \$\{MILES_TEST_UNSET_VAR\} is not set"):
        HarborTasksEnvironment(d).tasks("test")


def test_a_directory_with_malformed_tasks_loads_the_rest(tmp_path: Path) -> None:
    make_task(tmp_path, "good")
    _write(tmp_path / "bad-toml", {"task.toml": "version = [unclosed\n", "instruction.md": "x\n"})
    make_task(tmp_path, "no-instruction")
    (tmp_path / "no-instruction" / "instruction.md").unlink()
    make_task(tmp_path, "bad-field")
    (tmp_path / "bad-field" / "task.toml").write_text('[verifier]\ntimeout_sec = "soon"\n')
    _write(
        tmp_path / "bad-step", {"task.toml": '[[steps]]\nname = "a"\n', "environment/Dockerfile": "FROM x\n"}
    )
    env = HarborTasksEnvironment(tmp_path)
    assert [t.id for t in env.tasks("test")] == ["good"]
    problems = dict(p.split(": ", 1) for p in env.load_problems())
    assert sorted(problems) == ["bad-field", "bad-step", "bad-toml", "no-instruction"]
    assert "verifier.timeout_sec: Input should be a valid number" in problems["bad-field"]
    assert "instruction.md: missing" in problems["no-instruction"]
    assert "steps/a/instruction.md: missing" in problems["bad-step"]
    assert "bad-toml/task.toml" in problems["bad-toml"]
    report = validate_env(str(tmp_path), quick=True)
    schema = report.stage("schema")
    assert not schema.passed and sum("did not load" in p for p in schema.problems) == 4
    assert report.stage("oracle").summary.startswith("1/1 ")  # the good one still ran


def test_a_separate_verifier_is_refused_by_name_never_run_in_the_agents_sandbox(tmp_path: Path) -> None:
    """Harbor 0.26 runs such a verifier in a container of its own with only the declared artifacts
    (mcm-2023-c-wordle); run in the agent's sandbox its tests would miss their tools, and read
    whatever the agent left. Explicit `shared` loads."""
    for name, toml in [
        ("separate", '[verifier]\nenvironment_mode = "separate"\n'),
        ("implied", '[verifier.environment]\ndocker_image = "python:3.12-slim"\n'),
        ("shared", '[verifier]\nenvironment_mode = "shared"\n'),
    ]:
        make_task(tmp_path, name)
        (tmp_path / name / "task.toml").write_text(toml)
    env = HarborTasksEnvironment(tmp_path)
    assert [t.id for t in env.tasks("test")] == ["shared"]
    problems = dict(p.split(": ", 1) for p in env.load_problems())
    for name in ("separate", "implied"):
        assert problems[name].endswith(
            "task.toml: [verifier] environment_mode = 'separate' (a verifier container of its own, "
            "given only the declared artifacts) is not supported here; only 'shared'"
        ), problems[name]


def test_the_verifier_runs_as_its_user(tmp_path: Path) -> None:
    """`[verifier] user` (Harbor: test.sh as that user, so agent code the tests import cannot read
    root's files): test.sh runs as nobody, who cannot list root's home, and still writes its
    reward (the log folder is given to it)."""
    graded = make_task(tmp_path, "graded")
    toml = graded / "task.toml"
    toml.write_text(toml.read_text().replace("[verifier]\n", '[verifier]\nuser = "nobody"\n'))
    (graded / "tests" / "test.sh").write_text(
        TEST_SH.replace('if [ "$(', 'if [ "$(id -un)" = nobody ] && ! ls /root >/dev/null 2>&1 && [ "$(', 1)
    )
    env = HarborTasksEnvironment(tmp_path)
    (task,) = env.tasks("test")
    assert task.verifier["user"] == "nobody"
    res = _oracle(env)
    assert res.error is None and res.score == 1.0, res.details
    assert _oracle(env, "true").score == 0.0


def test_an_agent_user_that_cannot_be_one_for_the_episode_is_refused(tmp_path: Path) -> None:
    """`[agent] user` becomes the built image's USER (tests/test_harbor_images.py runs it on both
    providers): refused by name where that cannot hold, steps whose agents differ and a prebuilt
    docker_image (no build to set it in)."""
    refusals = {
        "prebuilt": (
            '[agent]\nuser = 1000\n[environment]\ndocker_image = "ubuntu:24.04"\n',
            "task.toml: [agent] user = '1000' with [environment] docker_image: not supported here",
        ),
        "mixed": (
            '[agent]\nuser = "ubuntu"\n[[steps]]\nname = "one"\n[[steps]]\nname = "two"\n[steps.agent]\nuser = "root"\n',
            "task.toml: steps run their agents as different users ('root', 'ubuntu'): not supported here",
        ),
    }
    for name, (toml_text, _) in refusals.items():
        make_task(tmp_path, name)
        (tmp_path / name / "task.toml").write_text(toml_text)
    env = HarborTasksEnvironment(tmp_path)
    assert env.tasks("test") == []
    problems = dict(p.split(": ", 1) for p in env.load_problems())
    for name, (_, why) in refusals.items():
        assert why in problems[name], problems


def test_validate_shows_the_last_lines_of_a_failing_task(tmp_path: Path) -> None:
    d = make_task(tmp_path, "fails")
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\necho step one done\necho wrote nothing >&2\n")
    (d / "tests" / "test.sh").write_text(
        "echo checking /app/out/hello.txt\necho 'E   AssertionError: no such file' >&2\n"
        "echo 0 > /logs/verifier/reward.txt\n"
    )
    report = validate_env(str(d), quick=True)
    (problem,) = report.stage("oracle").problems
    assert problem.startswith("fails: oracle scored 0, want 1")
    assert "solution output (last lines):\n  | step one done\n  | wrote nothing" in problem
    # stderr (installers' noise: apt, curl) before stdout, so the tests' own lines come last
    assert (
        "verifier output (last lines):\n  | E   AssertionError: no such file\n  | checking /app/out/hello.txt"
        in problem
    )
    assert "| step one done" in report.render()


def test_a_network_need_is_named() -> None:
    from miles_env.adapters.harbor.diagnose import hint

    installer = "curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh\nuvx pytest\n"
    assert "astral's installer" in (hint("test.sh: line 2: uvx: command not found", installer) or "")
    assert "PEP 668" in (hint("error: externally-managed-environment\n\nx This environment is...") or "")
    assert "needs a package index" in (hint("ERROR: No matching distribution found for numpy") or "")
    assert "Debian archive" in (hint("E: Unable to locate package r-base-core") or "")
    assert "reach github.com" in (hint("curl: (6) Could not resolve host: github.com") or "")
    assert hint("AssertionError: 2 != 3") is None
    ran = "curl: (6) Could not resolve host: astral.sh\n=========== 4 failed, 1 passed in 0.13s ===========\n"
    assert hint(ran, installer) is None  # the tests ran: their failures are the reason, not the download
    assert "reach github.com" in (hint(ran + "curl: (6) Could not resolve host: github.com") or "")


def test_verifier_needs_of_the_stock_tb2_test_sh() -> None:
    stock = (
        "#!/bin/bash\napt-get update\napt-get install -y curl\n"
        "curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh\nsource $HOME/.local/bin/env\n"
        "uvx \\\n  -p 3.13 \\\n  -w pytest==8.4.1 \\\n  -w pytest-json-ctrf==0.3.5 \\\n"
        "  pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA\n"
        "pip3 install --break-system-packages requests==2.32.3 2>/dev/null || true\n"
        "git clone https://example.invalid/x.git\n"
    )
    needs = verifier_needs(stock)
    assert needs.uv_version == "0.9.7"
    assert needs.installs == (
        "apt-get update", "apt-get install -y curl", "pip3 install --break-system-packages requests==2.32.3",
    )  # fmt: skip
    assert needs.uvx == ("uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --version",)
    assert needs.other == ("git clone https://example.invalid/x.git",)
    assert not verifier_needs("echo 1 > /logs/verifier/reward.txt\n").any


def test_a_multi_step_episode_gives_the_agent_each_instruction_in_turn(tmp_path: Path) -> None:
    """ScriptedEngine -> TITO -> builtin harness, once per step, in one sandbox and one session."""
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.harnesses.builtin import BuiltinHarness
    from miles_env.models import load_tokenizer
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack
    from miles_env.types import Status

    env = HarborTasksEnvironment(make_steps_task(tmp_path))
    (task,) = env.tasks("test")
    replies = ["```sh\necho one > /app/notes.txt\n```", "DONE", "```sh\ncat extra.cfg >> notes.txt\n```", "DONE",
               "```sh\n[ -e /tmp/harbor/tests ] || echo clean > /app/audit.txt\n```", "DONE"]  # fmt: skip

    async def main():  # type: ignore[no-untyped-def]
        engine = ScriptedEngine(load_tokenizer("smollm2"), replies)
        async with open_stack(StackConfig(), engine=engine) as stack:
            return await run_episode(stack.rollout_context(env, BuiltinHarness()), task)

    ep = anyio.run(main)
    assert ep.status is Status.COMPLETED, ep.error
    assert ep.score == 1.0 and set(ep.reward.details["steps"]) == {"write", "extend", "audit"}
    users = [m["content"] for m in ep.metadata["transcript"] if m.get("role") == "user"]
    firsts = [next(u for u in users if s.instruction in u) for s in env.step_tasks(task)]
    assert [users.index(u) for u in firsts] == sorted(users.index(u) for u in firsts)  # in step order
    assert len(ep.metadata["harness"]["steps"]) == 3


def test_compose_sidecars_are_refused_by_name_where_they_cannot_run(tmp_path: Path) -> None:
    d = make_task(tmp_path, "sidecar")
    (d / "environment" / "api").mkdir()
    (d / "environment" / "api" / "Dockerfile").write_text("FROM python:3.12-slim\n")
    (d / "environment" / "docker-compose.yaml").write_text(
        "services:\n  main:\n    depends_on: [api, db]\n  api:\n    build:\n      context: ./api\n"
        "    environment: [MODE=test]\n    healthcheck:\n      test: [CMD, 'true']\n  db:\n    image: redis:7\n"
    )
    from miles_env.adapters.harbor.compose import sidecars

    api, db = sidecars(d / "environment")
    assert (api.name, api.build, api.environment, api.healthcheck) == (
        "api", str(d / "environment" / "api"), {"MODE": "test"}, ["CMD", "true"],
    )  # fmt: skip
    assert (db.name, db.image, db.build) == ("db", "redis:7", None)
    env = HarborTasksEnvironment(d)
    (task,) = env.tasks("test")

    class CloudSandbox:  # no start_sidecar: e2b's, daytona's, modal's (local and docker run them)
        pass

    with pytest.raises(
        TaskError, match=r"runs sidecar services \(api, db\), which this sandbox \(CloudSandbox\)"
    ):
        anyio.run(env.setup, task, CloudSandbox())


def test_the_hermetic_layer_wraps_the_tasks_dockerfile(tmp_path: Path) -> None:
    from miles_env.adapters.harbor.hermetic import hermetic_context

    env_dir = _write(tmp_path / "env", {
        "Dockerfile": "FROM golang:1.22 AS build\nRUN true\nFROM ubuntu:24.04\nRUN useradd -m agent\nUSER agent\n",
        ".dockerignore": "*\n!data\n", "data/x.txt": "x\n",
    })  # fmt: skip
    cache = tmp_path / "cache"
    for name in ("uv", "uvx"):  # the wheel's binaries, as uv_binaries leaves them (no download here)
        _write(cache / "uv" / "0.9.5", {name: "#!/bin/sh\n"})
    stock = "apt-get install -y curl\ncurl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh\nuvx -w pytest==8.4.1 pytest t.py\n"
    ctx, needs = hermetic_context(env_dir, [stock], cache)
    assert needs.uv_version == "0.9.5" and ctx != env_dir
    assert hermetic_context(env_dir, [stock], cache)[0] == ctx  # made once per content
    lines = (ctx / "Dockerfile").read_text().splitlines()
    at = lines.index("FROM ubuntu:24.04")
    assert lines[at + 2] == "COPY .miles-hermetic/bin/ /root/.local/bin/"  # right after the final FROM
    assert lines[-4:] == ["USER root", "COPY .miles-hermetic/ /opt/miles-hermetic/",
                          'RUN ["/bin/sh", "/opt/miles-hermetic/provision.sh"]', "USER agent"]  # fmt: skip
    script = (ctx / ".miles-hermetic" / "provision.sh").read_text()
    assert "step 'apt-get install -y curl'" in script and "uvx -w pytest==8.4.1 pytest --version" in script
    assert '"$home/.local/bin/"' in script and "getent passwd agent" in script
    assert (ctx / ".dockerignore").read_text().endswith("!.miles-hermetic\n!.miles-hermetic/**\n")
    assert (env_dir / "Dockerfile").read_text().count("miles") == 0  # the task's own files untouched
    assert hermetic_context(env_dir, ["echo 1 > /logs/verifier/reward.txt\n"], cache)[0] == env_dir


def test_a_python_the_images_apt_lacks_is_staged_from_the_distribution_that_builds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`uvx -p 3.13` on an image whose apt has no python3.13 (Ubuntu noble): a portable CPython made
    once on the host from Debian trixie's packages goes into the context with install-python.sh,
    tried after the image's apt and before the uvx warm-up; a minor no distribution here builds
    stages nothing. (The real download, patch and install run in tests/test_harbor_images.py and
    tests/test_adapters_harbor_pythons.py.)"""
    from miles_env.adapters.harbor import pythons
    from miles_env.adapters.harbor.hermetic import hermetic_context

    made = []

    def make(minor: str, arch: tuple[str, str, str], out: Path, cache: Path) -> str:
        made.append(minor)
        _write(
            out,
            {
                "runtime-3.13.5/libc.so.6": "",
                "cpython-3.13.5-linux-x86_64-gnu/bin/python3.13": "",
                "VERSION": "3.13.5\n",
            },
        )
        return "3.13.5"

    monkeypatch.setattr(pythons, "_make", make)
    monkeypatch.setattr(pythons.platform, "machine", lambda: "x86_64")
    cache = tmp_path / "cache"
    for name in ("uv", "uvx"):
        _write(cache / "uv" / "0.9.5", {name: "#!/bin/sh\n"})
    stock = (
        "curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh\nuvx -p 3.13 -w pytest==8.4.1 pytest t.py\n"
    )
    for i in range(2):
        env_dir = _write(
            tmp_path / f"env{i}", {"Dockerfile": f"FROM ubuntu:24.04\nRUN echo {i}\nUSER agent\n"}
        )
        ctx, _ = hermetic_context(env_dir, [stock], cache)
        extra = ctx / ".miles-hermetic"
        assert sorted(p.name for p in (extra / "python").iterdir()) == [
            "cpython-3.13.5-linux-x86_64-gnu", "runtime-3.13.5",
        ]  # fmt: skip
        assert (extra / "install-python.sh").read_text() == pythons.INSTALL_SH
        script = (extra / "provision.sh").read_text().splitlines()
        apt = next(
            i for i, ln in enumerate(script) if "apt-get install -y --no-install-recommends python3.13" in ln
        )
        ours = next(i for i, ln in enumerate(script) if "install-python.sh 3.13.5 agent" in ln)
        warm = next(i for i, ln in enumerate(script) if "uvx -p 3.13 -w pytest==8.4.1 pytest --version" in ln)
        assert apt < ours < warm
    assert made == ["3.13"]  # made once for both contexts
    env_dir = _write(tmp_path / "old", {"Dockerfile": "FROM ubuntu:24.04\n"})
    ctx, _ = hermetic_context(env_dir, ["uvx -p 3.9 -w pytest==8.4.1 pytest t.py\n"], cache)
    assert not (ctx / ".miles-hermetic" / "python").exists()
    assert "install-python.sh" not in (ctx / ".miles-hermetic" / "provision.sh").read_text()
