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

from miles_env.adapters.framework_harness import FRAMEWORK_ROLE
from miles_env.adapters.worker_env import WorkerEnvironment
from miles_env.harness import Endpoint, HarnessResult
from miles_env.types import Status, Task

__all__ = ["HudEnvironment"]


class HudEnvironment(WorkerEnvironment):
    adapter, script = "hud", "hud_worker.py"

    def __init__(self, ref: str, name: str | None = None) -> None:
        self.path = str(Path(ref).expanduser().resolve())
        super().__init__(name or f"hud:{ref}", f"HUD environment {self.path}", (self.path,))

    def make_task(self, row: dict[str, Any]) -> Task:
        return Task(
            id=str(row["id"]),
            env=self.name,
            instruction=f"HUD template {row['template']} with {row['args']}",
            split=self.split,
            verifier={"idx": row["idx"]},
            metadata={"adapter": "hud", "path": self.path, "idx": row["idx"], "args": row["args"]},
        )

    @classmethod
    def episode_args(cls, task: Task) -> tuple[str, ...]:
        return (task.metadata["path"],)

    @classmethod
    def mounts(cls, args: tuple[str, ...]) -> list[str]:
        return [str(Path(args[0]).parent)]

    @classmethod
    def run_params(cls, task: Task, endpoint: Endpoint, base_url: str, **config: Any) -> dict[str, Any]:
        return {**super().run_params(task, endpoint, base_url), "timeout": 600}

    @classmethod
    def result(cls, task: Task, answer: dict[str, Any]) -> HarnessResult:
        details = {"error": answer["error"]}
        transcript: list[dict[str, Any]] = [
            {"role": "assistant", "content": answer["answer"]},
            {"role": FRAMEWORK_ROLE, "reward": answer["reward"], "details": details},
        ]
        if answer["error"]:
            return HarnessResult(Status.FAILED, transcript, f"hud rollout: {answer['error']}", details)
        return HarnessResult(Status.COMPLETED, transcript, None, details)
