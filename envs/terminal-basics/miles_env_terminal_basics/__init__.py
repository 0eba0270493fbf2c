"""terminal-basics: terminal tasks in four tiers, graded by checks run in the sandbox.

Tiers (task.metadata["tier"]): 1 = one command (write a word to a file, create a
file or directory, copy, rename, delete); 2 = a command with one option or a
redirect (count lines, sort, head, chmod, append); 3 = pipelines (grep, sort,
uniq, wc); 4 = small scripts (shebang scripts, loops, sed, awk).

Invariant: tasks are generated deterministically from `templates.TEMPLATES`;
ids are `<template>-<n>` and never change between runs, every split holds every
tier, and every task carries a reference solution that passes its checks.
"""

from __future__ import annotations

from functools import cache

from miles_env.checks import ChecksEnvironment
from miles_env.registry import make_task
from miles_env.types import SandboxSpec, Task
from miles_env_terminal_basics.templates import TEMPLATES

__all__ = ["TerminalBasics", "build_tasks"]

NAME = "terminal-basics"


@cache
def build_tasks() -> tuple[Task, ...]:
    tasks = []
    for tpl in TEMPLATES:
        n_train = len(tpl.variants) - tpl.n_test
        for i, variant in enumerate(tpl.variants):
            draft = tpl.build(*variant)
            tasks.append(
                make_task(
                    id=f"{tpl.name}-{i + 1}",
                    env=NAME,
                    instruction=draft.instruction,
                    split="train" if i < n_train else "test",
                    sandbox=SandboxSpec(files=draft.files),
                    verifier={"checks": draft.checks},
                    solution=draft.solution,
                    metadata={"tier": tpl.tier, "template": tpl.name},
                )
            )
    return tuple(tasks)


class TerminalBasics(ChecksEnvironment):
    name = NAME
    description = "Terminal tasks in 4 tiers (one command .. small scripts); a 135M model can learn tier 1."
    splits = ("train", "test")

    def tasks(self, split: str | None = None) -> list[Task]:
        return [t for t in build_tasks() if split is None or t.split == split]
