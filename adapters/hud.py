"""HUD adapter: `@env.template` tasks on HUD's local runtime, driven by HUD's own agent.

Concept: `hud:/path/env.py`, a file declaring a `hud.Environment` with templates
and a `hud.eval.Taskset` (or a list of Task rows). The worker (hud venv, Python
3.11-3.12) runs each episode with `hud.eval.rollout(task, OpenAIChatAgent,
runtime=LocalRuntime(file))`; the agent's OpenAI base URL is the episode's TITO
session, so every model token is captured. The reward is HUD's own grade (what the
template yields after receiving the answer). Telemetry is off
(`HUD_TELEMETRY_ENABLED=false`). Tasks: every row in split `test`.
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

__all__ = ["HudEnvironment", "run_episode"]


class HudEnvironment(Environment):
    splits = ("test",)

    def __init__(self, ref: str, name: str | None = None) -> None:
        self.path = str(Path(ref).expanduser().resolve())
        self.name = name or f"hud:{ref}"
        self.description = f"HUD environment {self.path}"
        self._tasks: list[Task] | None = None

    def tasks(self, split: str | None = None) -> list[Task]:
        if split not in (None, "test"):
            return []
        if self._tasks is None:
            rows = worker_rows("hud", self.name, "hud_worker.py", self.path)
            self._tasks = [
                Task(
                    id=str(r["id"]),
                    env=self.name,
                    instruction=f"HUD template {r['template']} with {r['args']}",
                    split="test",
                    verifier={"idx": r["idx"]},
                    metadata={"adapter": "hud", "path": self.path, "idx": r["idx"], "args": r["args"]},
                )
                for r in rows
            ]
            remember_counts(self.name, {"test": len(self._tasks)})  # for `env list`
        return list(self._tasks)

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return adapter_sandbox_spec()

    async def verify(self, task: Task, sandbox: Sandbox, transcript: Transcript) -> Reward:
        return framework_reward(task, transcript)


async def run_episode(
    task: Task, sandbox: Sandbox, endpoint: Endpoint, *, isolation: Isolation = Isolation.SANDBOX, **_: Any
) -> HarnessResult:
    path = task.metadata["path"]
    async with episode_worker(
        "hud",
        "hud_worker.py",
        (path,),
        sandbox=sandbox,
        endpoint=endpoint,
        isolation=isolation,
        mounts=(str(Path(path).parent),),
    ) as (worker, base_url):
        params = run_params(task, endpoint, base_url, timeout=600)
        r = await worker.call("run", params, timeout=900)
    details = {"error": r["error"]}
    transcript: list[dict[str, Any]] = [
        {"role": "assistant", "content": r["answer"]},
        {"role": FRAMEWORK_ROLE, "reward": r["reward"], "details": details},
    ]
    if r["error"]:
        return HarnessResult(Status.FAILED, transcript, f"hud rollout: {r['error']}", details)
    return HarnessResult(Status.COMPLETED, transcript, None, details)
