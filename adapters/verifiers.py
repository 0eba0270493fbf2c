"""Prime Intellect Verifiers adapter: a verifiers.v1 taskset, its own agent loop and rubric.

Concept: `verifiers:TASKSET` (an installed taskset id) or `verifiers:/path/mod.py`
(a module exporting a `Taskset`). The worker (in the verifiers venv) lists the
tasks and runs each episode with verifiers' `null` harness (its chat program) in a
subprocess runtime, with the model client's base URL set to the episode's TITO
session: every model token is captured by our proxy. The reward is the taskset's own
(`trace.reward`, the weighted sum of its `@vf.reward` functions).

Tasks: every task in split `test` (`verifiers:...?split=train` puts them in `train`).

`--harness framework` with `keep_trace=true` keeps verifiers' own trace of the episode
(`Trace.model_dump`, what `vf-replay` re-scores offline) in the reward's details as
`trace`; off by default, since a trace can be large.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_env.adapters.framework_harness import FRAMEWORK_ROLE
from miles_env.adapters.worker_env import WorkerEnvironment
from miles_env.harness import Endpoint, HarnessResult
from miles_env.types import Status, Task

__all__ = ["VerifiersEnvironment", "worker_args"]


def worker_args(ref: str) -> tuple[str, ...]:
    """(taskset id, extra sys.path entries) for a reference."""
    if ref.endswith(".py"):
        p = Path(ref).expanduser().resolve()
        return (p.stem, str(p.parent))
    return (ref,)


class VerifiersEnvironment(WorkerEnvironment):
    adapter, script = "verifiers", "verifiers_worker.py"

    def __init__(self, ref: str, name: str | None = None) -> None:
        self.ref = ref
        super().__init__(name or f"verifiers:{ref}", f"verifiers taskset {ref}", worker_args(ref))

    def make_task(self, row: dict[str, Any]) -> Task:
        return Task(
            id=str(row["id"]),
            env=self.name,
            instruction=row["prompt"] or str(row["id"]),
            split=self.split,
            verifier={"idx": row["idx"], "key": row["key"]},
            metadata={"adapter": "verifiers", "ref": self.ref, "idx": row["idx"]},
        )

    @classmethod
    def episode_args(cls, task: Task) -> tuple[str, ...]:
        return worker_args(task.metadata["ref"])

    @classmethod
    def mounts(cls, args: tuple[str, ...]) -> list[str]:
        return list(args[1:])  # the taskset module's folder, when given by path

    @classmethod
    def run_params(cls, task: Task, endpoint: Endpoint, base_url: str, **config: Any) -> dict[str, Any]:
        params = {**super().run_params(task, endpoint, base_url), "session": endpoint.session_id}
        return {**params, "keep_trace": bool(config.get("keep_trace", False))}

    @classmethod
    def result(cls, task: Task, answer: dict[str, Any]) -> HarnessResult:
        details = {k: answer[k] for k in ("rewards", "ok", "errors", "trace_errors")}
        if "trace" in answer:  # keep_trace: verifiers' own record of the episode
            details["trace"] = answer["trace"]
        transcript: list[dict[str, Any]] = [{"role": "user", "content": task.instruction}]
        transcript.append({"role": "assistant", "content": answer.get("reply", "")})
        transcript.append({"role": FRAMEWORK_ROLE, "reward": answer["reward"], "details": details})
        errors = answer["errors"] + answer["trace_errors"]
        if errors:
            return HarnessResult(Status.FAILED, transcript, "; ".join(errors)[:2000], details)
        return HarnessResult(Status.COMPLETED, transcript, None, details)
