"""terminal-hard: multi-step terminal tasks (fix a script, pass given tests, parse logs).

Meant for capable models; graded by the same check language as terminal-basics
(miles_env.checks), with checks that probe inputs beyond the instruction's example.
Invariant: ids are fixed strings from `tasks.TASKS`; each task has a reference
solution that passes its checks in the local sandbox.
"""

from __future__ import annotations

from functools import cache

from miles_env.checks import ChecksEnvironment
from miles_env.registry import make_task
from miles_env.types import SandboxSpec, Task
from miles_env_terminal_hard.tasks import TASKS

__all__ = ["TerminalHard", "build_tasks"]

NAME = "terminal-hard"


@cache
def build_tasks() -> tuple[Task, ...]:
    return tuple(
        make_task(
            id=t.id,
            env=NAME,
            instruction=t.instruction,
            split=t.split,
            sandbox=SandboxSpec(files=t.files),
            verifier={"checks": t.checks},
            solution=t.solution,
            metadata={"category": t.category, "difficulty": "hard"},
        )
        for t in TASKS
    )


class TerminalHard(ChecksEnvironment):
    name = NAME
    description = "Harder multi-step terminal tasks: debug scripts, write Python to pass tests, parse logs."
    splits = ("train", "test")

    def tasks(self, split: str | None = None) -> list[Task]:
        return [t for t in build_tasks() if split is None or t.split == split]
