"""Harbor task directories, run in our sandboxes (no harbor package needed).

Concept: `harbor:/path` lists every task directory at or below `/path` (one level) as a
test-split Task (taskdir.py reads them; a malformed one is listed in `problems` and the rest
load). Any harness can act on a task; `verify` uploads `tests/` after the agent is done (the
agent never sees tests or solution), runs `test.sh` with `[verifier.env]` and reads the reward
file, as Harbor's verifier does. A multi-step task (steps.py) is `Stepped`: the rollout acts once
per step, `end_step` verifies each step but the last, `verify` the last and combines them.

Invariant: Harbor's absolute paths `/logs`, `/tests`, `/solution` are rebased under
`/tmp/harbor` (files.py); the verifier clears `/tmp/harbor/logs` before it runs and removes
the tests after, so nothing the agent wrote can fake a reward and no later step sees earlier
tests. The Dockerfile is built by the docker provider and replayed by `setup` elsewhere
(replay.py).

Lifecycle: task directories are re-read on each `tasks()` call; the step ledger lives as long
as the environment object.
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import Any

from miles_env.adapters.framework_harness import FRAMEWORK_ROLE, framework_reward
from miles_env.adapters.harbor.compose import sidecars
from miles_env.adapters.harbor.diagnose import hint
from miles_env.adapters.harbor.files import HARBOR_ROOT, read_tree, rebase_paths, upload
from miles_env.adapters.harbor.hermetic import (
    VERIFY_ENV,
    agent_user_context,
    hermetic_context,
    verifier_needs,
)
from miles_env.adapters.harbor.steps import StepLedger, combine, passes, step_tests
from miles_env.adapters.harbor.taskdir import TaskProblem, find_task_dirs, load_tasks, read_task_dir
from miles_env.environment import Environment, Transcript
from miles_env.errors import TaskError
from miles_env.harness import Endpoint, HarnessResult
from miles_env.models import cache_dir
from miles_env.sandbox import RunsSidecars, Sandbox, SandboxProvider
from miles_env.types import Resources, Reward, SandboxSpec, Task

__all__ = [
    "HarborTasksEnvironment",
    "HARBOR_ROOT",
    "TaskProblem",
    "parse_reward",
    "parse_rewards",
    "rebase_paths",
    "read_task_dir",
    "find_task_dirs",
    "run_harbor_trial",
    "score_of",
]


def parse_rewards(txt: str | None, js: str | None) -> dict[str, float]:
    """Harbor's reward files: reward.json (a number, or a table of named numbers) wins, as in
    harbor's Verifier; else reward.txt's number, as {"reward": x}."""
    if js is not None and js.strip():
        data = json.loads(js)
        if isinstance(data, int | float) and not isinstance(data, bool):
            return {"reward": float(data)}
        if not isinstance(data, dict):
            raise TaskError(f"reward.json: expected a number or a table of numbers, got {js.strip()[:80]!r}")
        out = {k: float(v) for k, v in data.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    elif txt is not None and txt.strip():
        out = {"reward": float(txt.strip().split()[0])}
    else:
        raise TaskError("verifier wrote neither /logs/verifier/reward.txt nor reward.json")
    if not all(math.isfinite(v) for v in out.values()):
        raise TaskError(f"non-finite reward in {out}")
    return out


def score_of(rewards: dict[str, float]) -> float:
    """The episode's one number: `reward` when named, else the mean of the keys."""
    if "reward" in rewards:
        return rewards["reward"]
    return sum(rewards.values()) / len(rewards) if rewards else 0.0


def parse_reward(txt: str | None, js: str | None) -> tuple[float, dict[str, Any]]:
    rewards = parse_rewards(txt, js)
    return score_of(rewards), {"rewards": rewards}


class HarborTasksEnvironment(Environment):
    """`harbor:/path`: a Harbor task directory, or a directory of them."""

    splits = ("test",)

    def __init__(self, path: str | Path, name: str | None = None, *, hermetic: bool = True) -> None:
        """`hermetic`: what tests/test.sh installs is provisioned when the image builds and the
        verifier runs offline (hermetic.py); False builds the task's Dockerfile as it is."""
        self.path = Path(path).expanduser().resolve()
        self.hermetic = hermetic
        self.name = name or f"harbor:{path}"
        self.description = f"Harbor tasks in {self.path}"
        self.problems: list[TaskProblem] = []  # the task folders the last tasks() could not read
        self._ledger = StepLedger()

    def tasks(self, split: str | None = None) -> list[Task]:
        if split not in (None, "test"):
            return []
        tasks, self.problems = load_tasks(self.path, self.name)
        if not tasks and len(self.problems) == 1:  # one task asked for, and it is malformed
            raise TaskError(self.problems[0].reason)
        return tasks

    def load_problems(self) -> list[str]:
        """`folder: reason` for each task folder that did not load (env validate lists them)."""
        return [f"{p.path.name}: {p.reason}" for p in self.problems]

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        """The task's Dockerfile as a build context (with the hermetic layer, when its tests
        install anything): the providers that build images build it, others ignore it."""
        env_dir = Path(task.verifier["task_dir"]) / "environment"
        if task.sandbox.image or not (env_dir / "Dockerfile").is_file():
            return task.sandbox
        context = env_dir
        if self.hermetic:
            context, _ = hermetic_context(env_dir, _test_scripts(task), cache_dir() / "harbor")
        if agent_user := task.verifier.get("agent_user"):
            context = agent_user_context(context, agent_user, cache_dir() / "harbor")
        return task.sandbox.model_copy(update={"build": str(context)})

    def _verify_env(self, task: Task) -> dict[str, str] | None:
        """[verifier.env], and offline settings for uv and pip where the build provisioned them."""
        env = dict(task.verifier.get("env") or {})
        built = (
            not task.sandbox.image
            and (Path(task.verifier["task_dir"]) / "environment" / "Dockerfile").is_file()
        )
        if self.hermetic and built and verifier_needs("\n".join(_test_scripts(task))).any:
            env = {**VERIFY_ENV, **env}
        return env or None

    async def setup(self, task: Task, sandbox: Sandbox) -> None:
        """The task's docker-compose sidecars, started beside the sandbox where it can run them;
        elsewhere the task is refused by name. The Dockerfile itself is the provider's to build."""
        services = sidecars(Path(task.verifier["task_dir"]) / "environment")
        if services and not isinstance(sandbox, RunsSidecars):
            names = ", ".join(s.name for s in services)
            raise TaskError(
                f"task {task.id!r}: environment/docker-compose.yaml runs sidecar services ({names}), which "
                f"this sandbox ({type(sandbox).__name__}) cannot run beside it; use the local or docker provider"
            )
        for s in services:
            assert isinstance(sandbox, RunsSidecars)
            await sandbox.start_sidecar(
                s.name, image=s.image, build=s.build, dockerfile=s.dockerfile, env=s.environment,
                command=s.command, healthcheck=s.healthcheck,
            )  # fmt: skip

    async def stage_solution(self, task: Task, sandbox: Sandbox) -> None:
        """The oracle's step before `task.solution`: solution/ uploaded byte for byte (any size)."""
        root = Path(task.verifier["task_dir"])
        step = task.verifier.get("step")
        sol = root / "steps" / step / "solution" if step else root / "solution"
        await sandbox.exec(f"rm -rf {HARBOR_ROOT}/solution", timeout=30)
        await upload(sandbox, f"{HARBOR_ROOT}/solution", read_tree(sol))

    # -- multi-step tasks (miles_env.environment.Stepped) --

    def step_tasks(self, task: Task) -> list[Task]:
        out = []
        for s in task.verifier.get("steps") or []:
            res = task.sandbox.resources.model_copy(update={"agent_timeout_s": s["agent_timeout_s"]})
            out.append(task.model_copy(update={
                "instruction": s["instruction"], "solution": s["solution"],
                "sandbox": task.sandbox.model_copy(update={"resources": Resources.model_validate(res)}),
                "verifier": {**task.verifier, "step": s["name"]},
            }))  # fmt: skip
        return out

    async def begin_step(self, task: Task, step: Task, sandbox: Sandbox) -> None:
        """steps/<name>/workdir/ into the working directory, then its setup.sh there."""
        name = step.verifier["step"]
        self._ledger.begin(sandbox.id, first=name == task.verifier["steps"][0]["name"])
        files = read_tree(Path(task.verifier["task_dir"]) / "steps" / name / "workdir")
        if files:
            await upload(sandbox, sandbox.workdir, files)
        if any(f.rel == "setup.sh" for f in files):
            res = await sandbox.exec(["bash", "setup.sh"], cwd=sandbox.workdir, timeout=600)
            if not res.ok:
                tail = (res.stderr or res.stdout).strip()[-300:]
                raise TaskError(f"task {task.id!r}, step {name!r}: setup.sh exited {res.exit_code}: {tail}")
        spec = next(s for s in task.verifier["steps"] if s["name"] == name)
        if spec.get("healthcheck"):
            await _healthy(sandbox, spec["healthcheck"], f"task {task.id!r}, step {name!r}")

    async def end_step(self, task: Task, step: Task, sandbox: Sandbox) -> bool:
        name = step.verifier["step"]
        spec = next(s for s in task.verifier["steps"] if s["name"] == name)
        rewards, _ = await self._run_tests(task, sandbox, name)
        ok = rewards is not None and passes(rewards, spec["min_reward"])
        self._ledger.record(sandbox.id, name, rewards or {}, stopped=not ok)
        return ok

    async def verify(self, task: Task, sandbox: Sandbox, transcript: Transcript) -> Reward:
        if any(m.get("role") == FRAMEWORK_ROLE for m in transcript):  # Harbor's own verifier already ran
            return framework_reward(task, transcript)
        steps = task.verifier.get("steps") or []
        if not steps:
            rewards, one = await self._run_tests(task, sandbox, None)
            if rewards is None:
                return Reward(score=0.0, details=one)
            return Reward(score=score_of(rewards), details={**one, "rewards": rewards})
        done = self._ledger.done(sandbox.id)
        details: dict[str, Any] = {}
        if not self._ledger.stopped(sandbox.id) and len(done) < len(steps):
            name = steps[len(done)]["name"]
            last, details = await self._run_tests(task, sandbox, name)
            done = [*done, (name, last or {})]
        rewards = combine([r for _, r in done], task.verifier.get("reward_strategy", "mean"))
        details["steps"] = {n: r for n, r in done}
        return Reward(score=score_of(rewards), details={**details, "rewards": rewards})

    async def _run_tests(
        self, task: Task, sandbox: Sandbox, step: str | None
    ) -> tuple[dict[str, float] | None, dict[str, Any]]:
        """Upload the tests, run test.sh, read the reward files: (rewards or None, details)."""
        logs, tests = f"{HARBOR_ROOT}/logs", f"{HARBOR_ROOT}/tests"
        spec: dict[str, Any] = next((s for s in task.verifier.get("steps") or [] if s["name"] == step), {})
        # The sandbox's USER is the agent's where the task names one: the tests, and what clears and
        # removes them, run as the image's own (Harbor: the verifier's user, else the image's USER)
        own = task.verifier.get("image_user") if task.verifier.get("agent_user") else None
        user = spec.get("verifier_user") or task.verifier.get("user") or own
        mkdir = f"rm -rf {logs} {tests} && mkdir -p {logs}/verifier {logs}/agent"
        if user is not None and user != own:  # the log folders test.sh's to write: given to its user
            # where the clearing runs as root, else world-writable (Harbor's reset_dirs: chmod 777)
            both = f"{logs}/verifier {logs}/agent"
            mkdir += f" && {{ chown {shlex.quote(user)} {both} 2>/dev/null || chmod 777 {both}; }}"
        prep = await sandbox.exec(mkdir, timeout=60, user=own)
        dirs, script = step_tests(Path(task.verifier["task_dir"]), step)
        try:
            if not prep.ok:
                raise TaskError(prep.stderr.strip()[-500:])
            for d in dirs:
                await upload(sandbox, tests, read_tree(d), user=own)
        except TaskError as e:
            raise TaskError(f"task {task.id!r}: could not upload tests: {e}") from e
        timeout = spec.get("verifier_timeout_s") or task.verifier.get("timeout_s", 600.0)
        res = await sandbox.exec(
            f"bash {tests}/{script}",
            timeout=timeout,
            cwd=sandbox.workdir,
            env={**(self._verify_env(task) or {}), **spec.get("verifier_env", {})} or None,
            user=user,  # None: the image's USER; a sandbox that cannot run as another user refuses one
        )
        txt = await _maybe_read(sandbox, f"{logs}/verifier/reward.txt")
        js = await _maybe_read(sandbox, f"{logs}/verifier/reward.json")
        stdout = await _maybe_read(sandbox, f"{logs}/verifier/test-stdout.txt")
        await sandbox.exec(f"rm -rf {tests}", timeout=60, user=own)
        output = (res.stderr + res.stdout + (stdout or ""))[-4000:]  # the tests' own lines last
        details: dict[str, Any] = {"test_exit_code": res.exit_code, "test_output": output}
        if res.timed_out:
            details["error"] = f"test.sh timed out after {timeout:g}s"
        try:
            rewards: dict[str, float] | None = parse_rewards(txt, js)
        except (TaskError, ValueError) as e:
            rewards, details["error"] = None, details.get("error") or str(e)
        if rewards is None or score_of(rewards) < 1.0:
            scripts = "\n".join(_test_scripts(task))
            if (why := hint(output, scripts)) is not None:
                details["hint"] = why
        return rewards, details

    @staticmethod
    async def run_episode(task: Task, sandbox: Sandbox, endpoint: Endpoint, **config: Any) -> HarnessResult:
        """`--harness framework`: Harbor's own agent (default terminus-2) on the TITO session."""
        from miles_env.adapters.harbor.trial import run_episode

        return await run_episode(task, sandbox, endpoint, **config)


def _test_scripts(task: Task) -> list[str]:
    """Every test.sh of the task (the shared one, each step's), as text."""
    root = Path(task.verifier["task_dir"])
    paths = [root / "tests" / "test.sh", *(root / "steps" / s["name"] / "tests" / "test.sh"
                                           for s in task.verifier.get("steps") or [])]  # fmt: skip
    return [p.read_text(errors="replace") for p in paths if p.is_file()]


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
        await env.setup(task, sandbox)  # the sidecars, as for a native episode
        return await trial_in_sandbox(sandbox, task_dir, agent, trials_dir=trials_dir)


async def _healthy(sandbox: Sandbox, check: dict[str, Any], what: str) -> None:
    """Harbor's step healthcheck: `command` passes within retries + 1 tries, `interval_sec` apart."""
    import anyio

    for attempt in range(int(check["retries"]) + 1):
        res = await sandbox.exec(check["command"], timeout=float(check["timeout_sec"]))
        if res.ok:
            return
        if attempt < int(check["retries"]):
            await anyio.sleep(float(check["interval_sec"]))
    raise TaskError(
        f"{what}: healthcheck {check['command']!r} failed: {(res.stderr or res.stdout).strip()[-200:]}"
    )


async def _maybe_read(sandbox: Sandbox, path: str) -> str | None:
    res = await sandbox.exec(f"cat {shlex.quote(path)}", timeout=30)
    return res.stdout if res.exit_code == 0 else None
