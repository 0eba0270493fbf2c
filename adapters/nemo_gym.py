"""NeMo Gym adapter: a resources server with its `/verify`, NeMo Gym's own simple_agent loop.

Concept: `nemo-gym:NAME` (a resources server shipped with nemo-gym, e.g. `mcqa`) or
`nemo-gym:/path/app.py`, optionally `?data=/path/rows.jsonl` (default: the server's
`data/example.jsonl`). The worker (nemo-gym venv, Python >= 3.12) runs the resources
server, and per episode an `openai_model` server pointed at the episode's TITO
session (Responses API) plus a `simple_agent`; `POST /run` on the agent seeds the
session, runs the loop and calls `/verify`, whose `reward` is the episode's reward.
No head server and no `ng_run` (which wants the network). Tasks: every row in `test`.
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

__all__ = ["NemoGymEnvironment", "run_episode"]


class NemoGymEnvironment(Environment):
    splits = ("test",)

    def __init__(self, ref: str, name: str | None = None) -> None:
        target, _, data = ref.partition("?data=")
        # Absolute paths: the worker's cwd is the sandbox's workspace, not ours.
        if target.endswith(".py"):
            target = str(Path(target).expanduser().resolve())
        if data:
            data = str(Path(data).expanduser().resolve())
        self.args = (target, data) if data else (target,)
        self.name = name or f"nemo-gym:{ref}"
        self.description = f"NeMo Gym resources server {target}"
        self._tasks: list[Task] | None = None

    def tasks(self, split: str | None = None) -> list[Task]:
        if split not in (None, "test"):
            return []
        if self._tasks is None:
            rows = worker_rows("nemo-gym", self.name, "nemo_gym_worker.py", *self.args)
            seen: set[str] = set()
            self._tasks = []
            for r in rows:
                tid = r["id"] if r["id"] not in seen else f"{r['id']}-{r['idx']}"
                seen.add(tid)
                self._tasks.append(
                    Task(
                        id=tid,
                        env=self.name,
                        instruction=r["prompt"] or tid,
                        split="test",
                        verifier={"idx": r["idx"]},
                        metadata={"adapter": "nemo-gym", "args": list(self.args), "idx": r["idx"]},
                    )
                )
            remember_counts(self.name, {"test": len(self._tasks)})  # for `env list`
        return list(self._tasks)

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return adapter_sandbox_spec()

    async def verify(self, task: Task, sandbox: Sandbox, transcript: Transcript) -> Reward:
        return framework_reward(task, transcript)


def _mounts(args: tuple[str, ...]) -> list[str]:
    """The directories of a resources server file and a data file given by path."""
    target, data = args[0], (args[1] if len(args) > 1 else "")
    paths = [target] if target.endswith(".py") else []
    return [str(Path(p).expanduser().resolve().parent) for p in [*paths, data] if p]


async def run_episode(
    task: Task,
    sandbox: Sandbox,
    endpoint: Endpoint,
    *,
    max_turns: int = 4,
    isolation: Isolation = Isolation.SANDBOX,
    **_: Any,
) -> HarnessResult:
    args = tuple(task.metadata["args"])
    async with episode_worker(
        "nemo-gym",
        "nemo_gym_worker.py",
        args,
        sandbox=sandbox,
        endpoint=endpoint,
        isolation=isolation,
        mounts=_mounts(args),
    ) as (worker, base_url):
        params = run_params(task, endpoint, base_url, max_steps=max_turns, timeout=600)
        r = await worker.call("run", params, timeout=900)
    transcript: list[dict[str, Any]] = [
        {"role": "user", "content": task.instruction},
        {"role": "assistant", "content": r["answer"]},
        {"role": FRAMEWORK_ROLE, "reward": r["reward"], "details": r["verify"]},
    ]
    return HarnessResult(Status.COMPLETED, transcript, None, {"verify": r["verify"]})
