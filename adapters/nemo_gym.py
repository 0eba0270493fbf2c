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

from miles_env.adapters.framework_harness import FRAMEWORK_ROLE
from miles_env.adapters.worker_env import WorkerEnvironment
from miles_env.harness import Endpoint, HarnessResult
from miles_env.types import Status, Task

__all__ = ["NemoGymEnvironment"]


class NemoGymEnvironment(WorkerEnvironment):
    adapter, script = "nemo-gym", "nemo_gym_worker.py"

    def __init__(self, ref: str, name: str | None = None) -> None:
        target, _, data = ref.partition("?data=")
        # Absolute paths: the worker's cwd is the sandbox's workspace, not ours.
        if target.endswith(".py"):
            target = str(Path(target).expanduser().resolve())
        if data:
            data = str(Path(data).expanduser().resolve())
        args = (target, data) if data else (target,)
        super().__init__(name or f"nemo-gym:{ref}", f"NeMo Gym resources server {target}", args)

    def make_task(self, row: dict[str, Any]) -> Task:
        return Task(
            id=row["id"],
            env=self.name,
            instruction=row["prompt"] or row["id"],
            split=self.split,
            verifier={"idx": row["idx"]},
            metadata={"adapter": "nemo-gym", "args": list(self.args), "idx": row["idx"]},
        )

    def make_tasks(self, rows: list[dict[str, Any]]) -> list[Task]:
        """Rows may repeat an id: a repeat gets `-<idx>` appended."""
        seen: set[str] = set()
        out = []
        for r in rows:
            tid = r["id"] if r["id"] not in seen else f"{r['id']}-{r['idx']}"
            seen.add(tid)
            out.append(self.make_task({**r, "id": tid}))
        return out

    @classmethod
    def episode_args(cls, task: Task) -> tuple[str, ...]:
        return tuple(task.metadata["args"])

    @classmethod
    def mounts(cls, args: tuple[str, ...]) -> list[str]:
        """The directories of a resources server file and a data file given by path."""
        target, data = args[0], (args[1] if len(args) > 1 else "")
        paths = [target] if target.endswith(".py") else []
        return [str(Path(p).expanduser().resolve().parent) for p in [*paths, data] if p]

    @classmethod
    def run_params(
        cls, task: Task, endpoint: Endpoint, base_url: str, *, max_turns: int = 4, **config: Any
    ) -> dict[str, Any]:
        return {**super().run_params(task, endpoint, base_url), "max_steps": max_turns, "timeout": 600}

    @classmethod
    def result(cls, task: Task, answer: dict[str, Any]) -> HarnessResult:
        transcript: list[dict[str, Any]] = [
            {"role": "user", "content": task.instruction},
            {"role": "assistant", "content": answer["answer"]},
            {"role": FRAMEWORK_ROLE, "reward": answer["reward"], "details": answer["verify"]},
        ]
        return HarnessResult(Status.COMPLETED, transcript, None, {"verify": answer["verify"]})
