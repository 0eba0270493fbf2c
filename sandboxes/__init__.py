"""Sandbox providers, looked up by name; each provider module is imported only when asked for.

`get_provider("local", bwrap=...)` -> LocalSandboxProvider(LocalSandboxConfig(bwrap=...)).
Providers: local (bubblewrap), docker (any Docker-API engine), e2b, daytona, modal,
agentenv (cloud SDKs, imported only when that provider is built). Two tables name
them: PROVIDERS (the provider classes) and PROVIDER_CONFIGS (their config classes,
whose modules import without any SDK, so a run config can validate a provider's
config on a host that lacks it). A provider may also be Reapable or AsyncClosable
(miles_env/sandbox.py); `SandboxPool` (pool.py) wraps any provider, and so does `FleetProvider`
(fleet.py: the creation rate shared through buckets.py, a starting cap, retries, a warm pool),
which the stack puts in front of every provider it builds.

Layout: a provider is a module or subpackage here (local/, docker/, e2b.py, ...);
what more than one of them needs lives beside them (execargs.py, results.py,
expose.py, ownership.py, cloud.py, pool.py, fleet.py, buckets.py), never inside a sibling.
fleet_config.py is the run config's `fleet:` section (pydantic only, like the provider configs).
"""

from __future__ import annotations

from typing import Any

from miles_env.errors import ConfigError
from miles_env.plugins import PluginTable
from miles_env.sandbox import SandboxProvider

__all__ = ["PROVIDERS", "PROVIDER_CONFIGS", "get_provider"]

PROVIDERS = PluginTable(
    "sandbox provider",
    {
        "local": "miles_env.sandboxes.local.provider:LocalSandboxProvider",
        "docker": "miles_env.sandboxes.docker.provider:DockerSandboxProvider",
        "e2b": "miles_env.sandboxes.e2b:E2BSandboxProvider",
        "daytona": "miles_env.sandboxes.daytona:DaytonaSandboxProvider",
        "modal": "miles_env.sandboxes.modal:ModalSandboxProvider",
        "agentenv": "miles_env.sandboxes.agentenv:AgentEnvSandboxProvider",
    },
)

PROVIDER_CONFIGS = PluginTable(
    "sandbox provider",
    {
        "local": "miles_env.sandboxes.local.config:LocalSandboxConfig",
        "docker": "miles_env.sandboxes.docker.config:DockerSandboxConfig",
        "e2b": "miles_env.sandboxes.e2b:E2BSandboxConfig",
        "daytona": "miles_env.sandboxes.daytona:DaytonaSandboxConfig",
        "modal": "miles_env.sandboxes.modal:ModalSandboxConfig",
        "agentenv": "miles_env.sandboxes.agentenv:AgentEnvSandboxConfig",
    },
)


def get_provider(name: str = "local", **config: Any) -> SandboxProvider:
    """Build the provider `name`; keyword arguments become its config's fields."""
    config_cls = PROVIDER_CONFIGS.load(name)  # an unknown name: ConfigError listing the known ones
    try:
        cfg = config_cls(**config)
    except ValueError as e:  # pydantic.ValidationError is a ValueError
        raise ConfigError(f"sandbox provider {name!r}: invalid config: {e}") from e
    provider: SandboxProvider = PROVIDERS.load(name)(cfg)
    return provider
