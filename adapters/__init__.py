"""Adapters: environments written for other frameworks, run through our Environment contract.

`load_adapter_environment("harbor:/path/to/tasks")` routes a name whose prefix is
a known adapter (harbor, hud, nemo-gym, openenv, verifiers) to that adapter, by
`ADAPTERS`, the family's one PluginTable: prefix -> its Environment class, built
as `cls(ref, name=...)`, whose `run_episode(task, sandbox, endpoint, **config)` is
what the framework harness runs. Framework packages live in their own venvs (see
`venv.py`) and are driven by a worker over stdio (`worker_client.py`); the
worker-backed environments share `worker_env.WorkerEnvironment`; Harbor task
directories are read natively (`harbor/`).
"""

from __future__ import annotations

from miles_env.environment import Environment, Transcript
from miles_env.errors import ConfigError, RegistryError
from miles_env.plugins import PluginTable
from miles_env.sandbox import Sandbox
from miles_env.types import Reward, SandboxSpec, Task

__all__ = ["ADAPTERS", "SplitEnvironment", "is_adapter_name", "load_adapter_environment"]

ADAPTERS = PluginTable(
    "adapter",
    {
        "harbor": "miles_env.adapters.harbor:HarborTasksEnvironment",
        "hud": "miles_env.adapters.hud:HudEnvironment",
        "nemo-gym": "miles_env.adapters.nemo_gym:NemoGymEnvironment",
        "openenv": "miles_env.adapters.openenv:OpenEnvEnvironment",
        "verifiers": "miles_env.adapters.verifiers:VerifiersEnvironment",
    },
)


def is_adapter_name(name: str) -> bool:
    prefix, sep, rest = name.partition(":")
    return bool(sep) and prefix in ADAPTERS.targets and bool(rest)


class SplitEnvironment(Environment):
    """Every task of an adapter environment, in one named split (`...?split=train` for training)."""

    def __init__(self, inner: Environment, split: str, name: str) -> None:
        self.inner, self.split, self.name = inner, split, name
        self.splits = (split,)
        self.description = inner.description

    def tasks(self, split: str | None = None) -> list[Task]:
        if split not in (None, self.split):
            return []
        return [t.model_copy(update={"split": self.split, "env": self.name}) for t in self.inner.tasks(None)]

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return self.inner.sandbox_spec(task)

    async def setup(self, task: Task, sandbox: Sandbox) -> None:
        await self.inner.setup(task, sandbox)

    async def verify(self, task: Task, sandbox: Sandbox, transcript: Transcript) -> Reward:
        return await self.inner.verify(task, sandbox, transcript)


def load_adapter_environment(name: str) -> Environment:
    """`<adapter>:<ref>[?split=NAME]`; with `?split=`, every task is put in that split."""
    base, _, split = name.partition("?split=")
    if split:
        return SplitEnvironment(load_adapter_environment(base), split, name)
    prefix, _, ref = name.partition(":")
    try:
        cls = ADAPTERS.load(prefix)
    except ConfigError as e:
        raise RegistryError(f"environment {name!r}: {e}") from None
    env: Environment = cls(ref, name=name)
    return env
