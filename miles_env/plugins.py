"""Plug-ins by name: the one lookup idiom of every family we ship.

A family (engine kinds, sandbox providers, harnesses, trainer backends) is a
`PluginTable`: a name maps to a `"module:attr"` target, imported only when that
name is asked for, so the core never imports a provider, an engine or a harness
at module level (INVARIANTS.md, layering). An unknown name is a ConfigError that
lists the known ones. Environments written by users are found the other way, by
entry point (`miles_env.registry`), because they live in other distributions.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from miles_env.errors import ConfigError

__all__ = ["PluginTable"]


@dataclass(frozen=True)
class PluginTable:
    family: str  # how errors name the family: "sandbox provider", "engine kind", ...
    targets: Mapping[str, str]  # name -> "package.module:attribute"

    def names(self) -> list[str]:
        return sorted(self.targets)

    def target(self, name: str) -> str:
        found = self.targets.get(name)
        if found is None:
            raise ConfigError(f"{self.family} {name!r} is unknown; known: {', '.join(self.names())}")
        return found

    def load(self, name: str) -> Any:
        """Import and return the attribute `name` maps to."""
        module, _, attr = self.target(name).partition(":")
        return getattr(importlib.import_module(module), attr)
