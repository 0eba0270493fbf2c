"""WorkerEnvironment: an environment backed by a framework worker in its own venv.

Concept: hud, nemo-gym, verifiers and openenv have one shape. Tasks are listed by
a one-shot worker (`tasks`, in the framework's venv) and cached; every task
carries in its metadata what an episode needs to start the worker again (the
harness gets the task, never the environment object); an episode starts a worker
with `episode_worker` (inside the episode's sandbox unless `isolation="none"`),
lets the framework's agent loop run against the TITO session (`run`), and turns
its answer into a HarnessResult whose final `framework` message carries the
framework's own reward, which `verify` reads back. A subclass says only what
differs: how a reference becomes worker arguments, a listed row a Task, a task
its worker arguments and mounts, the `run` parameters, and the answer a result.

Invariant: listing costs one worker start and is cached per environment object;
the counts go to the discovery cache (`env list`). A worker that crashes, hangs or
answers garbage raises `WorkerError`, which the framework harness records as a
failed episode; a bad reference fails the listing with a one-line error naming
the environment.

Lifecycle: `run_episode` is a classmethod (the harness has only the task); the
worker it starts is closed when the episode ends.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

from miles_env.adapters.counts import remember_counts
from miles_env.adapters.framework_harness import framework_reward
from miles_env.adapters.isolation import Isolation, adapter_sandbox_spec, episode_worker
from miles_env.adapters.venv import worker_rows
from miles_env.adapters.worker_client import WorkerClient
from miles_env.environment import Environment, Transcript
from miles_env.harness import Endpoint, HarnessResult
from miles_env.sandbox import Sandbox
from miles_env.types import Reward, SandboxSpec, Task

__all__ = ["WorkerEnvironment"]


class WorkerEnvironment(Environment):
    """Tasks listed and episodes run by `adapter`'s worker script `script`."""

    adapter: ClassVar[str]  # the framework: its venv and its name prefix ("hud")
    script: ClassVar[str]  # the worker script under adapters/workers/ ("hud_worker.py")
    run_timeout_s: ClassVar[float] = 900.0  # the `run` call's limit (the framework's own loop)
    split: str = "test"  # the one split listed tasks go to
    splits: tuple[str, ...] = ("test",)

    def __init__(self, name: str, description: str, args: Sequence[str]) -> None:
        self.name, self.description = name, description
        self.args = tuple(args)  # the listing worker's command-line arguments
        self._tasks: list[Task] | None = None

    # -- listing -----------------------------------------------------------------------------
    @abc.abstractmethod
    def make_task(self, row: dict[str, Any]) -> Task:
        """One Task from one row of the worker's `tasks` answer."""

    def make_tasks(self, rows: list[dict[str, Any]]) -> list[Task]:
        return [self.make_task(r) for r in rows]

    def tasks(self, split: str | None = None) -> list[Task]:
        if split not in (None, self.split):
            return []
        if self._tasks is None:
            self._tasks = self.make_tasks(worker_rows(self.adapter, self.name, self.script, *self.args))
            remember_counts(self.name, {self.split: len(self._tasks)})  # for `env list`
        return list(self._tasks)

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return adapter_sandbox_spec()

    async def verify(self, task: Task, sandbox: Sandbox, transcript: Transcript) -> Reward:
        return framework_reward(task, transcript)

    # -- episodes (the framework harness calls `run_episode` with the task only) -------------
    @classmethod
    @abc.abstractmethod
    def episode_args(cls, task: Task) -> tuple[str, ...]:
        """The episode worker's command-line arguments, from the task's metadata."""

    @classmethod
    def mounts(cls, args: tuple[str, ...]) -> list[str]:
        """Host directories of the environment's own files, bound read-only in the sandbox."""
        return []

    @classmethod
    def run_params(cls, task: Task, endpoint: Endpoint, base_url: str, **config: Any) -> dict[str, Any]:
        """The `run` call's parameters: the task's index and the session as the model endpoint."""
        return {
            "idx": task.metadata["idx"],
            "base_url": base_url,
            "api_key": endpoint.api_key,
            "model": endpoint.model,
        }

    @classmethod
    def result(cls, task: Task, answer: dict[str, Any]) -> HarnessResult:
        """The episode's result from the worker's `run` answer."""
        raise NotImplementedError(f"{cls.__name__} drives its own episodes")

    @classmethod
    async def drive(
        cls, worker: WorkerClient, task: Task, endpoint: Endpoint, base_url: str, **config: Any
    ) -> HarnessResult:
        """One episode on a started worker: by default one `run` call (the framework's loop)."""
        params = cls.run_params(task, endpoint, base_url, **config)
        answer = await worker.call("run", params, timeout=cls.run_timeout_s)
        return cls.result(task, answer)

    @classmethod
    async def run_episode(
        cls,
        task: Task,
        sandbox: Sandbox,
        endpoint: Endpoint,
        *,
        isolation: Isolation = Isolation.SANDBOX,
        **config: Any,
    ) -> HarnessResult:
        """The framework harness's episode: a worker for this task, driven to a result."""
        args = cls.episode_args(task)
        async with episode_worker(
            cls.adapter,
            cls.script,
            args,
            sandbox=sandbox,
            endpoint=endpoint,
            isolation=isolation,
            mounts=cls.mounts(args),
        ) as (worker, base_url):
            return await cls.drive(worker, task, endpoint, base_url, **config)
