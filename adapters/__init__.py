"""Adapters: environments written for other frameworks, run through our Environment contract.

`load_adapter_environment("harbor:/path/to/tasks")` routes a name whose prefix is
a known adapter (harbor, hud, nemo-gym, openenv, verifiers) to that adapter.
Framework packages live in their own venvs (see `venv.py`) and are driven by a
worker over stdio (see `base.py`); Harbor task directories are also read natively.
"""

from __future__ import annotations

from miles_env.environment import Environment
from miles_env.errors import RegistryError

__all__ = ["ADAPTER_PREFIXES", "is_adapter_name", "load_adapter_environment"]

ADAPTER_PREFIXES = ("harbor", "hud", "nemo-gym", "openenv", "verifiers")


def is_adapter_name(name: str) -> bool:
    prefix, sep, rest = name.partition(":")
    return bool(sep) and prefix in ADAPTER_PREFIXES and bool(rest)


def load_adapter_environment(name: str) -> Environment:
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
