"""Harbor task directories, read natively and run in our sandboxes (no harbor package needed).

Concept: a Harbor task is a directory with `task.toml`, `instruction.md`,
`environment/` (a Dockerfile and the files it copies), `tests/test.sh` (writes
`/logs/verifier/reward.txt` or `reward.json`) and `solution/solve.sh`. The
environment `harbor:/path` lists every task directory at or below `/path` (one
level) as a test-split Task; any harness can act on it; `verify` uploads `tests/`
after the agent is done (the agent never sees tests or solution), runs
`test.sh` and reads the reward file, as Harbor's verifier does.

Invariant: Harbor's absolute paths `/logs`, `/tests`, `/solution` are rebased
under `/tmp/harbor` (the only absolute place every sandbox can write, since the
local sandbox's root is read-only); the verifier clears `/tmp/harbor/logs`
before it runs, so nothing the agent wrote there can fake a reward. tests/ and
solution/ arrive byte for byte with their modes (files.py). The Dockerfile is built
by the docker provider and replayed by `setup` elsewhere (replay.py).

Lifecycle: stateless; task directories are re-read on each `tasks()` call.
"""

from __future__ import annotations

import json
import shlex
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from miles_env.adapters.framework_harness import FRAMEWORK_ROLE, framework_reward
from miles_env.adapters.harbor.dockerfile import (
    Step,
    final_stage,
    parse_dockerfile,
    static_env,
)
from miles_env.adapters.harbor.files import HARBOR_ROOT, embed_script, read_tree, rebase_paths, upload
from miles_env.adapters.harbor.replay import run_setup
from miles_env.environment import Environment, Transcript
from miles_env.errors import ConfigError, TaskError
from miles_env.harness import Endpoint, HarnessResult
from miles_env.limits import parse_size_mb
from miles_env.sandbox import Sandbox, SandboxProvider
from miles_env.types import Resources, Reward, SandboxSpec, Task

__all__ = [
    "HarborTasksEnvironment",
    "HARBOR_ROOT",
    "parse_reward",
    "rebase_paths",
    "read_task_dir",
    "find_task_dirs",
    "run_harbor_trial",
]


def find_task_dirs(path: Path) -> list[Path]:
    if (path / "task.toml").is_file():
        return [path]
    if not path.is_dir():
        raise TaskError(f"harbor path {str(path)!r}: not a directory")
    dirs = sorted(p for p in path.iterdir() if (p / "task.toml").is_file())
    if not dirs:
        raise TaskError(f"harbor path {str(path)!r}: no task directories (with task.toml) found")
    return dirs


def _workdir(steps: list[Step]) -> str:
    """The final stage's last WORKDIR (Harbor's default /app)."""
    workdir = "/app"
    for step in final_stage(steps):
        if step.op == "WORKDIR" and step.args:
            workdir = step.args if step.args.startswith("/") else f"{workdir.rstrip('/')}/{step.args}"
    return workdir


def _resources(
    task_dir: Path, env_cfg: dict[str, Any], agent_cfg: dict[str, Any], ver_cfg: dict[str, Any]
) -> Resources:
    """Harbor's task.toml limits as ours: [environment] cpus, memory_mb (or memory = "2G"),
    storage_mb (or storage) -> disk_mb; [agent] timeout_sec -> agent_timeout_s (and the per-exec
    default, as before); [verifier] timeout_sec -> verifier_timeout_s. Unset fields keep our defaults.
    `allow_internet` (Harbor's default: true) is recorded in metadata; the sandbox stays offline."""
    memory = env_cfg.get("memory_mb", env_cfg.get("memory"))
    storage = env_cfg.get("storage_mb", env_cfg.get("storage"))
    agent_s, verifier_s = agent_cfg.get("timeout_sec"), ver_cfg.get("timeout_sec")
    fields: dict[str, Any] = {
        "memory_mb": 1024 if memory is None else parse_size_mb(memory, "environment.memory_mb"),
        "timeout_s": float(agent_s if agent_s is not None else 60.0),
        "cpus": env_cfg.get("cpus"),
        "agent_timeout_s": agent_s,
        "verifier_timeout_s": verifier_s,
    }
    if storage is not None:
        fields["disk_mb"] = parse_size_mb(storage, "environment.storage_mb")
    try:
        return Resources.model_validate(fields)
    except (ValidationError, ConfigError) as e:
        raise TaskError(f"{task_dir / 'task.toml'}: {e}") from e


def read_task_dir(task_dir: Path, env_name: str) -> Task:
    try:
        cfg = tomllib.loads((task_dir / "task.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise TaskError(f"{task_dir / 'task.toml'}: {e}") from e
    instruction_path = task_dir / "instruction.md"
    if not instruction_path.is_file():
        raise TaskError(f"{instruction_path}: missing")
    if not (task_dir / "tests" / "test.sh").is_file():
        raise TaskError(f"{task_dir / 'tests' / 'test.sh'}: missing")
    env_cfg, agent_cfg, ver_cfg = cfg.get("environment", {}), cfg.get("agent", {}), cfg.get("verifier", {})
    df = task_dir / "environment" / "Dockerfile"
    steps = parse_dockerfile(df.read_text()) if df.is_file() else []
    workdir = _workdir(steps)
    resources = _resources(task_dir, env_cfg, agent_cfg, ver_cfg)
    solution = _solution_script(task_dir / "solution", workdir)
    return Task(
        id=task_dir.name,
        env=env_name,
        instruction=instruction_path.read_text().strip() or task_dir.name,
        split="test",
        sandbox=SandboxSpec(
            image=env_cfg.get("docker_image"), env=static_env(steps), workdir=workdir, resources=resources
        ),
        verifier={"task_dir": str(task_dir), "timeout_s": float(ver_cfg.get("timeout_sec", 120.0))},
        solution=solution,
        metadata={
            "adapter": "harbor",  # `--harness framework` runs Harbor's own agent (harbor/trial.py)
            "harbor": {
                "metadata": cfg.get("metadata", {}),
                "version": cfg.get("version"),
                "allow_internet": bool(env_cfg.get("allow_internet", True)),
            },
        },
    )


def _solution_script(sol_root: Path, workdir: str) -> str | None:
    """`bash solve.sh` in the workdir, its files embedded (or staged by the oracle when too large)."""
    files = read_tree(sol_root)
    if not any(f.rel == "solve.sh" for f in files):
        return None
    sol_dir = f"{HARBOR_ROOT}/solution"
    embedded = embed_script(sol_dir, files)
    if embedded is None:
        size = sum(len(f.data) for f in files)
        embedded = (
            f"test -f {sol_dir}/solve.sh || {{ echo 'harbor: the solution files ({size} bytes) are too "
            "large for a script; the oracle runner uploads them (stage_solution)' >&2; exit 1; }"
        )
    return f"{embedded}\ncd {shlex.quote(workdir)} && bash {sol_dir}/solve.sh"


def parse_reward(txt: str | None, js: str | None) -> tuple[float, dict[str, Any]]:
    """Harbor's reward files: reward.txt holds one number; reward.json a dict of named numbers."""
    if txt is not None and txt.strip():
        return float(txt.strip().split()[0]), {"reward.txt": txt.strip()}
    if js is not None:
        data = json.loads(js)
        if isinstance(data, (int, float)):
            return float(data), {"reward.json": data}
        nums = {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}
        score = nums["reward"] if "reward" in nums else (sum(nums.values()) / len(nums) if nums else 0.0)
        return score, {"reward.json": data}
    raise TaskError("verifier wrote neither /logs/verifier/reward.txt nor reward.json")


class HarborTasksEnvironment(Environment):
    """`harbor:/path`: a Harbor task directory, or a directory of them."""

    splits = ("test",)

    def __init__(self, path: str | Path, name: str | None = None) -> None:
        self.path = Path(path).expanduser().resolve()
        self.name = name or f"harbor:{path}"
        self.description = f"Harbor tasks in {self.path}"

    def tasks(self, split: str | None = None) -> list[Task]:
        if split not in (None, "test"):
            return []
        return [read_task_dir(d, self.name) for d in find_task_dirs(self.path)]

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        """The task's Dockerfile as a build context: the docker provider builds it, others ignore it."""
        env_dir = Path(task.verifier["task_dir"]) / "environment"
        if task.sandbox.image or not (env_dir / "Dockerfile").is_file():
            return task.sandbox
        return task.sandbox.model_copy(update={"build": str(env_dir)})

    async def setup(self, task: Task, sandbox: Sandbox) -> None:
        """Replay the Dockerfile in the sandbox, unless the sandbox runs an image (built or docker_image)."""
        df = Path(task.verifier["task_dir"]) / "environment" / "Dockerfile"
        if not df.is_file() or _runs_image(sandbox):
            return
        try:
            await run_setup(sandbox, df, timeout=float(task.verifier.get("setup_timeout_s", 600.0)))
        except TaskError as e:
            raise TaskError(f"task {task.id!r}: {e}") from e

    async def stage_solution(self, task: Task, sandbox: Sandbox) -> None:
        """The oracle's step before `task.solution`: solution/ uploaded byte for byte (any size)."""
        await upload(
            sandbox, f"{HARBOR_ROOT}/solution", read_tree(Path(task.verifier["task_dir"]) / "solution")
        )

    async def verify(self, task: Task, sandbox: Sandbox, transcript: Transcript) -> Reward:
        if any(m.get("role") == FRAMEWORK_ROLE for m in transcript):  # Harbor's own verifier already ran
            return framework_reward(task, transcript)
        script = (
            f"rm -rf {HARBOR_ROOT}/logs {HARBOR_ROOT}/tests && mkdir -p {HARBOR_ROOT}/logs/verifier "
            f"{HARBOR_ROOT}/logs/agent"
        )
        prep = await sandbox.exec(script, timeout=60)
        try:
            if not prep.ok:
                raise TaskError(prep.stderr.strip()[-500:])
            await upload(
                sandbox, f"{HARBOR_ROOT}/tests", read_tree(Path(task.verifier["task_dir"]) / "tests")
            )
        except TaskError as e:
            raise TaskError(f"task {task.id!r}: could not upload tests: {e}") from e
        res = await sandbox.exec(
            f"bash {HARBOR_ROOT}/tests/test.sh",
            timeout=task.verifier.get("timeout_s", 120.0),
            cwd=sandbox.workdir,
        )
        txt = await _maybe_read(sandbox, f"{HARBOR_ROOT}/logs/verifier/reward.txt")
        js = await _maybe_read(sandbox, f"{HARBOR_ROOT}/logs/verifier/reward.json")
        details: dict[str, Any] = {
            "test_exit_code": res.exit_code,
            "test_output": (res.stdout + res.stderr)[-2000:],
        }
        try:
            score, more = parse_reward(txt, js)
        except (TaskError, ValueError) as e:
            return Reward(score=0.0, details={**details, "error": str(e)})
        return Reward(score=score, details={**details, **more})

    @staticmethod
    async def run_episode(task: Task, sandbox: Sandbox, endpoint: Endpoint, **config: Any) -> HarnessResult:
        """`--harness framework`: Harbor's own agent (default terminus-2) on the TITO session."""
        from miles_env.adapters.harbor.trial import run_episode

        return await run_episode(task, sandbox, endpoint, **config)


async def run_harbor_trial(
    task_dir: str | Path, agent: str, provider: SandboxProvider, *, trials_dir: str | Path | None = None
) -> dict[str, Any]:
    """One Harbor trial of `task_dir` with Harbor agent `agent`, in a fresh sandbox from `provider`."""
    from miles_env.adapters.harbor.trial import trial_in_sandbox

    task_dir = Path(task_dir).resolve()
    env = HarborTasksEnvironment(task_dir)
    (task,) = env.tasks("test")
    sandbox = await provider.create(env.sandbox_spec(task))
    async with sandbox:
        await env.setup(task, sandbox)  # the Dockerfile, as for a native episode
        return await trial_in_sandbox(sandbox, task_dir, agent, trials_dir=trials_dir)


def _runs_image(sandbox: Sandbox) -> bool:
    """A container made from the task's image or built from its Dockerfile (docker provider).

    The local bwrap sandbox ignores SandboxSpec.image and .build; so do providers that cannot
    build (their sandboxes have no `built_from`): for those the Dockerfile's steps are replayed.
    """
    from miles_env.sandboxes.local import LocalSandbox

    if isinstance(sandbox, LocalSandbox):
        return False
    spec = getattr(sandbox, "spec", None)
    return bool(getattr(spec, "image", None) or getattr(sandbox, "built_from", None))


async def _maybe_read(sandbox: Sandbox, path: str) -> str | None:
    res = await sandbox.exec(f"cat {shlex.quote(path)}", timeout=30)
    return res.stdout if res.exit_code == 0 else None
