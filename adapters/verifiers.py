"""Prime Intellect Verifiers adapter: a verifiers.v1 taskset, its own agent loop and rubric.

Concept: `verifiers:TASKSET` (an installed taskset id) or `verifiers:/path/mod.py`
(a module exporting a `Taskset`). The worker (in the verifiers venv) lists the
tasks and runs each episode with verifiers' `null` harness (its chat program) in a
subprocess runtime, with the model client's base URL set to the episode's TITO
session: every model token is captured by our proxy. The reward is the taskset's own
(`trace.reward`, the weighted sum of its `@vf.reward` functions).

Tasks: every task in split `test` (`verifiers:...?split=train` puts them in `train`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_env.adapters.discover import remember_counts
from miles_env.adapters.harness import FRAMEWORK_ROLE, framework_reward
from miles_env.adapters.isolation import Isolation, adapter_sandbox_spec, episode_worker, run_params
from miles_env.adapters.venv import worker_rows

from miles_env.environment import Environment, Transcript
from miles_env.harness import Endpoint, HarnessResult
from miles_env.sandbox import Sandbox
from miles_env.types import Reward, SandboxSpec, Status, Task

__all__ = ["VerifiersEnvironment", "run_episode", "worker_args"]


def worker_args(ref: str) -> tuple[str, ...]:
    """(taskset id, extra sys.path entries) for a reference."""
    if ref.endswith(".py"):
        p = Path(ref).expanduser().resolve()
        return (p.stem, str(p.parent))
    return (ref,)


class VerifiersEnvironment(Environment):
    def __init__(self, ref: str, name: str | None = None) -> None:
        self.ref, self.split = ref, "test"
        self.splits = (self.split,)
        self.name = name or f"verifiers:{ref}"
        self.description = f"verifiers taskset {ref}"
        self._tasks: list[Task] | None = None

    def tasks(self, split: str | None = None) -> list[Task]:
        if split not in (None, self.split):
            return []
        if self._tasks is None:
            rows = worker_rows("verifiers", self.name, "verifiers_worker.py", *worker_args(self.ref))
            self._tasks = [
                Task(
                    id=str(r["id"]),
                    env=self.name,
                    instruction=r["prompt"] or str(r["id"]),
                    split=self.split,
                    verifier={"idx": r["idx"], "key": r["key"]},
                    metadata={"adapter": "verifiers", "ref": self.ref, "idx": r["idx"]},
                )
                for r in rows
            ]
            remember_counts(self.name, {self.split: len(self._tasks)})  # for `env list`
        return list(self._tasks)

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return adapter_sandbox_spec()

    async def verify(self, task: Task, sandbox: Sandbox, transcript: Transcript) -> Reward:
        return framework_reward(task, transcript)


async def run_episode(
    task: Task, sandbox: Sandbox, endpoint: Endpoint, *, isolation: Isolation = Isolation.SANDBOX, **_: Any
) -> HarnessResult:
    args = worker_args(task.metadata["ref"])
    async with episode_worker(
        "verifiers",
        "verifiers_worker.py",
        args,
        sandbox=sandbox,
        endpoint=endpoint,
        isolation=isolation,
        mounts=args[1:],
    ) as (worker, base_url):
        params = run_params(task, endpoint, base_url, session=endpoint.session_id)
        r = await worker.call("run", params, timeout=900)
    details = {k: r[k] for k in ("rewards", "ok", "errors", "trace_errors")}
    transcript: list[dict[str, Any]] = [{"role": "user", "content": task.instruction}]
    transcript.append({"role": "assistant", "content": r.get("reply", "")})
    transcript.append({"role": FRAMEWORK_ROLE, "reward": r["reward"], "details": details})
    errors = r["errors"] + r["trace_errors"]
    if errors:
        return HarnessResult(Status.FAILED, transcript, "; ".join(errors)[:2000], details)
    return HarnessResult(Status.COMPLETED, transcript, None, details)
