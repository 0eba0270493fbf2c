"""Errors, named by the boundary they cross.

A bad rollout is data, not a crash: the orchestrator turns these into an
episode status. Configuration and user-input errors carry the field or path.
"""

from __future__ import annotations

__all__ = [
    "MilesEnvError",
    "ConfigError",
    "RegistryError",
    "TaskError",
    "SandboxError",
    "SandboxUnavailable",
    "SandboxThrottled",
    "EngineError",
    "HarnessError",
    "BudgetExceeded",
]


class MilesEnvError(Exception):
    """Base of every error miles-env raises on purpose."""


class ConfigError(MilesEnvError, ValueError):
    """A configuration value is wrong; the message names the field or path."""


class RegistryError(MilesEnvError, LookupError):
    """An environment (or plug-in) name is unknown or failed to load."""


class TaskError(MilesEnvError, ValueError):
    """A task definition is malformed."""


class SandboxError(MilesEnvError):
    """A sandbox could not be created, used or closed."""


class SandboxUnavailable(SandboxError):
    """The sandbox backend itself is missing (for example no `bwrap`)."""


class EngineError(MilesEnvError):
    """The inference engine failed, died or refused a request."""


class HarnessError(MilesEnvError):
    """An agent harness failed in a way that ends the episode."""


class BudgetExceeded(MilesEnvError):
    """A session budget (turns, tokens, context, wall time) was hit."""


class SandboxThrottled(SandboxError):
    """The sandbox backend refused for now (rate limit, quota, capacity): retrying later may work.

    `retry_after` is the backend's hint in seconds, when it gave one.
    """

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
