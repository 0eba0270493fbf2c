"""The Environment contract.

An environment owns a list of tasks per split, says what sandbox each needs,
prepares it, and grades the result by looking inside the sandbox. It never talks
to a model: harnesses do, through a TITO session.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Sequence
from fnmatch import fnmatch
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from miles_env.types import Reward, SandboxSpec, Task

if TYPE_CHECKING:
    from miles_env.sandbox import Sandbox

__all__ = ["Environment", "Stepped", "Transcript", "act_in_steps"]

# A harness's record of what happened, in OpenAI chat message form (role/content
# dicts). Verifiers may read it; training never does (it uses token ids).
Transcript = Sequence[dict[str, Any]]

_TEST_FILES = ("test_*", "*_test.*", "*.test.*", "conftest.py")


class Environment(abc.ABC):
    """Base class for environments registered under `miles_env.environments`."""

    name: str = ""
    description: str = ""
    splits: tuple[str, ...] = ("train", "test")
    # Where verify runs (miles_env/guards): "same", the agent's sandbox after the agent stopped;
    # "fresh", a new sandbox holding only the agent's final workspace.
    verify_in: str = "same"

    @abc.abstractmethod
    def tasks(self, split: str | None = None) -> list[Task]:
        """Tasks of one split, or of all splits when split is None."""

    def task(self, task_id: str) -> Task:
        for t in self.tasks():
            if t.id == task_id:
                return t
        raise KeyError(f"environment {self.name!r} has no task {task_id!r}")

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return task.sandbox

    async def setup(self, task: Task, sandbox: Sandbox) -> None:  # noqa: B027 - optional hook
        """Prepare the sandbox beyond `SandboxSpec.files` (default: nothing)."""

    def protected_paths(self, task: Task) -> list[str]:
        """Paths the agent must leave as they were (relative to the workdir or absolute; a trailing
        `/` is a directory): `task.metadata["protected_paths"]`, else the test files among the
        task's `SandboxSpec.files` (`test_*`, `*_test.*`, `*.test.*`, or under `tests/`, `test/`)."""
        declared = task.metadata.get("protected_paths")
        if isinstance(declared, list):
            return [str(p) for p in declared]
        out: set[str] = set()
        for path in task.sandbox.files:
            parts = PurePosixPath(path).parts
            dirs = [i for i, part in enumerate(parts[:-1]) if part in ("tests", "test")]
            if dirs:
                out.add(str(PurePosixPath(*parts[: dirs[0] + 1])) + "/")
            elif any(fnmatch(parts[-1], g) for g in _TEST_FILES):
                out.add(path)
        return sorted(out)

    @abc.abstractmethod
    async def verify(self, task: Task, sandbox: Sandbox, transcript: Transcript) -> Reward:
        """Grade the episode by inspecting the sandbox (and, optionally, the transcript)."""


@runtime_checkable
class Stepped(Protocol):
    """An environment some of whose tasks are several steps in one sandbox and one episode
    (Harbor's `[[steps]]`): each step its own instruction (and reference solution), the agent
    acting once per step, the step verified before the next begins; `verify` then grades the
    last step reached and gives the episode's reward from all of them."""

    def step_tasks(self, task: Task) -> list[Task]:
        """The steps as Tasks (instruction, solution, timeouts of the step), in order; [] for a
        task of one step."""
        ...

    async def begin_step(self, task: Task, step: Task, sandbox: Sandbox) -> None:
        """Prepare the sandbox for `step` (its files, its setup script)."""
        ...

    async def end_step(self, task: Task, step: Task, sandbox: Sandbox) -> bool:
        """Verify a step that is not the last one and keep its reward; False: stop here (its
        reward is under the step's minimum)."""
        ...


_R = TypeVar("_R")


async def act_in_steps(
    env: Environment, task: Task, sandbox: Sandbox, act: Callable[[Task], Awaitable[_R]]
) -> list[_R]:
    """`act(task)` once, or for a Stepped environment's task once per step, each step begun and
    (but the last) ended by the environment; the results in step order."""
    steps = env.step_tasks(task) if isinstance(env, Stepped) else []
    if not steps:
        return [await act(task)]
    assert isinstance(env, Stepped)
    out: list[_R] = []
    for i, step in enumerate(steps):
        await env.begin_step(task, step, sandbox)
        out.append(await act(step))
        if i < len(steps) - 1 and not await env.end_step(task, step, sandbox):
            break
    return out
