"""terminal-hard: multi-step terminal tasks (fix a script, pass given tests, parse logs).

Meant for capable models; graded by the same check language as terminal-basics
(miles_env.checks), with checks that probe inputs beyond the instruction's example.
Invariant: ids are fixed strings from `tasks.TASKS`; each task has a reference
solution that passes its checks in the local sandbox. Every task declares its
protected paths (`metadata["protected_paths"]`: its test files, [] when it has
none), so the guards (miles_env.guards) flag and restore an edited test. A task
with a `future` (tasks.py) gets a git repository in `setup`: its files as the first
commit, the future (the answer) as a later one, then `scrub_git` back to the first,
so `git log --all` shows the starting commit only (the image needs git).
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from miles_env.checks import ChecksEnvironment
from miles_env.errors import SandboxError
from miles_env.guards import scrub_git
from miles_env.registry import make_task
from miles_env.types import SandboxSpec, Task
from miles_env_terminal_hard.tasks import TASKS

if TYPE_CHECKING:
    from miles_env.sandbox import Sandbox

__all__ = ["TerminalHard", "build_tasks", "make_scrubbed_repo"]

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
            metadata={"category": t.category, "difficulty": "hard", "protected_paths": list(t.protected)},
        )
        for t in TASKS
    )


# the later commits, kept out of the Task (it is logged with every episode)
_FUTURE = {t.id: t.future for t in TASKS if t.future is not None}
_GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "terminal-hard",
    "GIT_AUTHOR_EMAIL": "terminal-hard@localhost",
    "GIT_COMMITTER_NAME": "terminal-hard",
    "GIT_COMMITTER_EMAIL": "terminal-hard@localhost",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",  # fixed: the same commit ids in every episode
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
}
_COMMIT = "git add -A && git -c commit.gpgsign=false commit -qm"


async def _git(sandbox: Sandbox, script: str) -> None:
    res = await sandbox.exec(["sh", "-c", script], timeout=60, env=_GIT_ENV)
    if not res.ok:
        raise SandboxError(f"terminal-hard setup: {script!r}: {res.stderr.strip()[-300:]}")


async def make_scrubbed_repo(sandbox: Sandbox, future: dict[str, str]) -> str:
    """The workdir as a repository: what is there as the first commit, `future` as a later one,
    then scrubbed back to the first; its id."""
    await _git(sandbox, f"git init -q -b main . && {_COMMIT} start")
    for path, text in future.items():
        await sandbox.write_file(path, text)
    await _git(sandbox, f"{_COMMIT} 'the fix'")
    return await scrub_git(sandbox, ".", "HEAD~1")


class TerminalHard(ChecksEnvironment):
    name = NAME
    description = "Harder multi-step terminal tasks: debug scripts, write Python to pass tests, parse logs."
    splits = ("train", "test")

    def tasks(self, split: str | None = None) -> list[Task]:
        return [t for t in build_tasks() if split is None or t.split == split]

    async def setup(self, task: Task, sandbox: Sandbox) -> None:
        future = _FUTURE.get(task.id)
        if future is not None:
            await make_scrubbed_repo(sandbox, future)
