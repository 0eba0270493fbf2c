"""A Harbor task directory read into a Task: task.toml, instruction.md or steps/, tests/, solution/.

Concept: `load_tasks(path)` lists every task directory at or below `path` (one level) and reads
each one with `read_task_dir`; a malformed one does not stop the others: it is returned as a
`TaskProblem` (the folder and a one-line reason naming the file or field). What the pinned
harbor (0.26, harbor/models/task/config.py) defines and we honour:

- `[environment]`: cpus, memory_mb (or memory = "2G"), storage_mb (or storage), docker_image,
  `env` (every exec: agent, solution, verifier), `workdir` (overrides the Dockerfile's WORKDIR),
  `allow_internet` / `network_mode` (public: the sandbox's network policy is `public`, outbound
  network but never the host's loopback; otherwise none, our default, where Harbor's is public);
- `[agent].timeout_sec`; `[verifier]` timeout_sec (Harbor's default 600 s) and `env` (the
  verifier's exec only); `[solution].env` (the reference solution only). `${VAR}` and
  `${VAR:-default}` values come from the host's environment, as Harbor resolves them;
- `[verifier] user` (a name or uid of the image: test.sh runs as that user, as `docker exec -u`;
  the log folders are made writable for it, as Harbor does); `[agent] user` (the built image's
  USER: every exec of the agent, of the oracle and of setup runs as it; test.sh as the verifier's
  user, else the Dockerfile's own last USER, else root, as in Harbor);
- `[[steps]]` with `steps/<name>/{instruction.md,tests/,solution/,workdir/}` (steps.py), each
  step's agent/verifier timeout_sec, verifier user and min_reward, and `multi_step_reward_strategy`.
Refused by name, never run with other semantics: `[verifier] environment_mode = "separate"` (or a
`[verifier.environment]`, which implies it), Harbor 0.26's verifier container of its own; steps
whose agents run as different users; `[agent] user` with a prebuilt `docker_image`.

Invariant: reading is pure (nothing runs); every TaskError names the file (and field) at fault.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from miles_env.adapters.harbor.config import HarborConfig, _Env
from miles_env.adapters.harbor.files import solution_script
from miles_env.adapters.harbor.steps import read_steps
from miles_env.adapters.harbor.templates import resolve_env
from miles_env.errors import ConfigError, MilesEnvError, TaskError
from miles_env.limits import parse_size_mb
from miles_env.sandboxes.images.dockerfile import Instruction, parse_dockerfile
from miles_env.types import NetworkPolicy, Resources, SandboxSpec, Task

__all__ = [
    "DEFAULT_VERIFIER_TIMEOUT_S",
    "TaskProblem",
    "final_stage",
    "find_task_dirs",
    "load_tasks",
    "read_task_dir",
]

DEFAULT_VERIFIER_TIMEOUT_S = 600.0  # harbor VerifierConfig.timeout_sec


@dataclass(frozen=True, slots=True)
class TaskProblem:
    path: Path  # the task folder
    reason: str  # one line


def find_task_dirs(path: Path) -> list[Path]:
    if (path / "task.toml").is_file():
        return [path]
    if not path.is_dir():
        raise TaskError(f"harbor path {str(path)!r}: not a directory")
    dirs = sorted(p for p in path.iterdir() if (p / "task.toml").is_file())
    if not dirs:
        raise TaskError(f"harbor path {str(path)!r}: no task directories (with task.toml) found")
    return dirs


def load_tasks(path: Path, env_name: str) -> tuple[list[Task], list[TaskProblem]]:
    """Every readable task under `path`, and a problem for each folder that is not."""
    tasks, problems = [], []
    for d in find_task_dirs(path):
        try:
            tasks.append(read_task_dir(d, env_name))
        except TaskError as e:
            problems.append(TaskProblem(d, str(e).replace("\n", " ")))
    return tasks, problems


def _config(task_dir: Path) -> HarborConfig:
    toml = task_dir / "task.toml"
    try:
        return HarborConfig.model_validate(tomllib.loads(toml.read_text()))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise TaskError(f"{toml}: {e}") from e
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        raise TaskError(f"{toml}: {field}: {err['msg']}") from e


def final_stage(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile's last stage, from its FROM on (images' parser)."""
    ins = [i for i in parse_dockerfile(text).instructions if i.op]
    starts = [n for n, i in enumerate(ins) if i.op == "FROM"]
    return ins[starts[-1] :] if starts else ins


def _workdir(stage: list[Instruction], declared: str | None) -> str:
    """[environment].workdir, else the final stage's last WORKDIR (Harbor's tasks: /app)."""
    if declared:
        return declared
    workdir = "/app"
    for ins in stage:
        if ins.op == "WORKDIR" and ins.args:
            workdir = ins.args if ins.args.startswith("/") else f"{workdir.rstrip('/')}/{ins.args}"
    return workdir


def _resources(toml: Path, cfg: HarborConfig, agent_s: float | None, verifier_s: float) -> Resources:
    """Harbor's limits as ours; unset ones keep our defaults."""
    e = cfg.environment
    memory = e.memory_mb if e.memory_mb is not None else e.memory
    storage = e.storage_mb if e.storage_mb is not None else e.storage
    fields: dict[str, Any] = {
        "timeout_s": float(agent_s if agent_s is not None else 60.0),
        "cpus": e.cpus,
        "agent_timeout_s": agent_s,
        "verifier_timeout_s": verifier_s,
    }
    try:
        fields["memory_mb"] = 1024 if memory is None else parse_size_mb(memory, "environment.memory_mb")
        if storage is not None:
            fields["disk_mb"] = parse_size_mb(storage, "environment.storage_mb")
        return Resources.model_validate(fields)
    except (ValidationError, ConfigError) as e:
        raise TaskError(f"{toml}: {e}") from e


def _network(env: _Env) -> NetworkPolicy:
    """A task that asks for the network (`allow_internet = true`, `network_mode = "public"`) gets
    it; any other runs offline, our default (Harbor's own default is public: the TB2 template says
    `allow_internet = true` explicitly). A run forbids it with `rollout.limits.network: none`."""
    mode = env.network_mode or ("public" if env.allow_internet else "no-network")
    return NetworkPolicy.PUBLIC if mode == "public" else NetworkPolicy.NONE


def read_task_dir(task_dir: Path, env_name: str) -> Task:
    cfg = _config(task_dir)
    toml = task_dir / "task.toml"
    df = task_dir / "environment" / "Dockerfile"
    try:
        stage = final_stage(df.read_text()) if df.is_file() else []
    except (ValueError, MilesEnvError) as e:
        raise TaskError(f"{df}: {e}") from e
    if not df.is_file() and not cfg.environment.docker_image:
        raise TaskError(f"{df}: missing (and no [environment] docker_image)")
    for where, phase in [("[verifier]", cfg.verifier)] + [
        (f"step {s.name!r}", s.verifier) for s in cfg.steps or []
    ]:
        if phase.separate:  # run in the agent's sandbox, its tests would find nothing they need
            raise TaskError(
                f"{toml}: {where} environment_mode = 'separate' (a verifier container of its own, "
                "given only the declared artifacts) is not supported here; only 'shared'"
            )
    agent_user = _agent_user(toml, cfg, df.is_file() and not cfg.environment.docker_image)
    workdir = _workdir(stage, cfg.environment.workdir)
    sol_env = resolve_env(cfg.solution.env, f"{toml} [solution.env]")
    steps = read_steps(task_dir, cfg, workdir, sol_env)
    if steps:
        instruction, solution = steps[0]["instruction"], steps[0]["solution"]
        agent_s = sum(s["agent_timeout_s"] or 0.0 for s in steps) or cfg.agent.timeout_sec
    else:
        instruction, solution = _single_step(task_dir, workdir, sol_env)
        agent_s = cfg.agent.timeout_sec
    verifier_s = cfg.verifier.timeout_sec or DEFAULT_VERIFIER_TIMEOUT_S
    env = resolve_env(cfg.environment.env, f"{toml} [environment.env]")  # the image's ENV applies by itself
    network = _network(cfg.environment)
    return Task(
        id=task_dir.name,
        env=env_name,
        instruction=instruction,
        split="test",
        sandbox=SandboxSpec(
            image=cfg.environment.docker_image,
            env=env,
            workdir=workdir,
            resources=_resources(toml, cfg, agent_s, verifier_s),
            network=network,
        ),  # fmt: skip
        verifier={
            "task_dir": str(task_dir),
            "timeout_s": verifier_s,
            "env": resolve_env(cfg.verifier.env, f"{toml} [verifier.env]"),
            "user": cfg.verifier.user_name,  # test.sh as this user (`docker exec -u`); None: the image's USER
            "agent_user": agent_user,  # the image's USER of the sandbox (sandbox_spec); None: the Dockerfile's
            "image_user": ([i.args.strip() for i in stage if i.op == "USER"] or ["root"])[-1],
            "steps": steps,
            "reward_strategy": cfg.multi_step_reward_strategy or "mean",
        },
        solution=solution,
        metadata={
            "adapter": "harbor",  # `--harness framework` runs Harbor's own agent (harbor/trial.py)
            "harbor": {
                "metadata": cfg.metadata,
                "steps": [s["name"] for s in steps],
                "allow_internet": network is not NetworkPolicy.NONE,
            },
        },
    )


def _agent_user(toml: Path, cfg: HarborConfig, built: bool) -> str | None:
    """`[agent] user` (each step's, else the task's): one user for the whole episode, made the
    image's USER by a last `USER` line (sandbox_spec), so every exec of the agent and of the oracle
    runs as it on every provider that builds; what the adapter runs after (the tests) names its own."""
    users = {s.agent.user_name or cfg.agent.user_name for s in cfg.steps or []} or {cfg.agent.user_name}
    if len(users) > 1:
        named = ", ".join(sorted(repr(u) if u else "the image's USER" for u in users))
        raise TaskError(f"{toml}: steps run their agents as different users ({named}): not supported here")
    (user,) = users
    if user is not None and not built:
        raise TaskError(
            f"{toml}: [agent] user = {user!r} with [environment] docker_image: not supported here (the "
            "user is set as the built image's USER); build it from environment/Dockerfile"
        )
    return user


def _single_step(task_dir: Path, workdir: str, sol_env: dict[str, str]) -> tuple[str, str | None]:
    instruction_path = task_dir / "instruction.md"
    if not instruction_path.is_file():
        raise TaskError(f"{instruction_path}: missing (and task.toml has no [[steps]])")
    if not (task_dir / "tests" / "test.sh").is_file():
        raise TaskError(f"{task_dir / 'tests' / 'test.sh'}: missing")
    text = instruction_path.read_text().strip() or task_dir.name
    return text, solution_script(task_dir / "solution", workdir, sol_env)
