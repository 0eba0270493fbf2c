"""Sandbox providers, looked up by name; each provider module is imported only when asked for.

`get_provider("local", bwrap=...)` -> LocalSandboxProvider(LocalSandboxConfig(bwrap=...)).
Providers: local (bubblewrap), docker (any Docker-API engine), e2b, daytona, modal,
agentenv (cloud SDKs, imported only when that provider is built). A provider may
also offer `async reap(ttl_s) -> list[str]` (orphan removal, see ownership.py);
`SandboxPool` (pool.py) wraps any provider.
"""

from __future__ import annotations

import importlib
from typing import Any

from miles_env.errors import ConfigError
from miles_env.sandbox import SandboxProvider

__all__ = ["get_provider", "KNOWN_PROVIDERS"]

# name -> (module, provider class, config class)
KNOWN_PROVIDERS: dict[str, tuple[str, str, str]] = {
    "local": ("miles_env.sandboxes.local", "LocalSandboxProvider", "LocalSandboxConfig"),
    "docker": ("miles_env.sandboxes.docker", "DockerSandboxProvider", "DockerSandboxConfig"),
    "e2b": ("miles_env.sandboxes.e2b", "E2BSandboxProvider", "E2BSandboxConfig"),
    "daytona": ("miles_env.sandboxes.daytona", "DaytonaSandboxProvider", "DaytonaSandboxConfig"),
    "modal": ("miles_env.sandboxes.modal", "ModalSandboxProvider", "ModalSandboxConfig"),
    "agentenv": ("miles_env.sandboxes.agentenv", "AgentEnvSandboxProvider", "AgentEnvSandboxConfig"),
}


def get_provider(name: str = "local", **config: Any) -> SandboxProvider:
    """Build the provider `name`; keyword arguments become its config's fields."""
    if name not in KNOWN_PROVIDERS:
        raise ConfigError(f"sandbox provider {name!r} is unknown; known: {sorted(KNOWN_PROVIDERS)}")
    module_name, cls_name, config_name = KNOWN_PROVIDERS[name]
    module = importlib.import_module(module_name)
    try:
        cfg = getattr(module, config_name)(**config)
    except ValueError as e:  # pydantic.ValidationError is a ValueError
        raise ConfigError(f"sandbox provider {name!r}: invalid config: {e}") from e
    provider: SandboxProvider = getattr(module, cls_name)(cfg)
    return provider
