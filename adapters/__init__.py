"""Adapters: environments written for other frameworks, run through our Environment contract.

`load_adapter_environment("harbor:/path/to/tasks")` routes a name whose prefix is
a known adapter (harbor, hud, nemo-gym, openenv, verifiers) to that adapter.
Framework packages live in their own venvs (see `venv.py`) and are driven by a
worker over stdio (see `worker_client.py`); Harbor task directories are also read natively.
"""

from __future__ import annotations

from miles_env.environment import Environment, Transcript
from miles_env.errors import RegistryError
from miles_env.sandbox import Sandbox
from miles_env.types import Reward, SandboxSpec, Task

__all__ = ["ADAPTER_PREFIXES", "SplitEnvironment", "is_adapter_name", "load_adapter_environment"]

ADAPTER_PREFIXES = ("harbor", "hud", "nemo-gym", "openenv", "verifiers")


def is_adapter_name(name: str) -> bool:
    prefix, sep, rest = name.partition(":")
    return bool(sep) and prefix in ADAPTER_PREFIXES and bool(rest)


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
    if prefix == "harbor":
        from miles_env.adapters.harbor import HarborTasksEnvironment

        return HarborTasksEnvironment(ref, name=name)
    if prefix == "openenv":
        from miles_env.adapters.openenv import OpenEnvEnvironment

        return OpenEnvEnvironment(ref, name=name)
    if prefix == "verifiers":
        from miles_env.adapters.verifiers import VerifiersEnvironment

        return VerifiersEnvironment(ref, name=name)
    if prefix == "hud":
        from miles_env.adapters.hud import HudEnvironment

        return HudEnvironment(ref, name=name)
    if prefix == "nemo-gym":
        from miles_env.adapters.nemo_gym import NemoGymEnvironment

        return NemoGymEnvironment(ref, name=name)
    raise RegistryError(
        f"environment {name!r}: the {prefix!r} adapter is not implemented in this build "
        f"(implemented: harbor, hud, nemo-gym, openenv, verifiers)"
    )
