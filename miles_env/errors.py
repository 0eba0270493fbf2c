"""Errors, named by the boundary they cross.

A bad rollout is data, not a crash: the orchestrator turns these into an
episode status. Configuration and user-input errors carry the field or path.
An error that ends an episode for a known reason carries its class (`end`, an
`EpisodeEnd`): the rollout records it as raised, never parsing a message; one
without a class gets its phase's (rollout.py).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from miles_env.types import EpisodeEnd

__all__ = [
    "MilesEnvError",
    "ConfigError",
    "RegistryError",
    "TaskError",
    "SandboxError",
    "SandboxUnavailable",
    "SandboxThrottled",
    "SandboxRateLimited",
    "EngineError",
    "EngineRefused",
    "HarnessError",
    "ClusterError",
]


class MilesEnvError(Exception):
    """Base of every error miles-env raises on purpose."""

    end: ClassVar[EpisodeEnd | None] = None  # the class of an episode it ends; None: its phase's


class ConfigError(MilesEnvError, ValueError):
    """A configuration value is wrong; the message names the field or path."""


class RegistryError(MilesEnvError, LookupError):
    """An environment (or plug-in) name is unknown or failed to load."""


class TaskError(MilesEnvError, ValueError):
    """A task definition is malformed."""


class SandboxError(MilesEnvError):
    """A sandbox could not be created, used or closed. Past its start (create and setup are the
    sandbox_start phase), the sandbox broke under the episode."""

    end = EpisodeEnd.SANDBOX_LOST


class SandboxUnavailable(SandboxError):
    """The sandbox backend itself is missing (for example no `bwrap`)."""


class EngineError(MilesEnvError):
    """The inference engine failed, died or refused a request."""

    end = EpisodeEnd.ENGINE_ERROR


class EngineRefused(EngineError):
    """The engine refused a request that cannot succeed as sent: retrying it is pointless.

    Raised for an engine's deterministic refusal (HTTP 400 from SGLang or vLLM, the `hf` engine's
    own checks); transient failures (5xx, timeouts, lost connections) stay plain EngineError.
    `reason` is "context_length" when the prompt, or prompt + max_new_tokens, does not fit the
    context, else "invalid_request". `prompt_tokens` and `limit` are the prompt length and the
    context limit as the engine stated them (SGLang's context length, vLLM's max_model_len, hf's
    max_context), when its message gives them. `str(e)` is the engine's message.
    """

    def __init__(
        self,
        message: str,
        reason: Literal["context_length", "invalid_request"],
        prompt_tokens: int | None = None,
        limit: int | None = None,
    ) -> None:
        super().__init__(message, reason, prompt_tokens, limit)  # args rebuild it (pickle, copy)
        self.message = message
        self.reason: Literal["context_length", "invalid_request"] = reason
        self.prompt_tokens = prompt_tokens
        self.limit = limit

    def __str__(self) -> str:
        return self.message


class HarnessError(MilesEnvError):
    """An agent harness failed in a way that ends the episode."""

    end = EpisodeEnd.HARNESS_CRASH


class SandboxThrottled(SandboxError):
    """The sandbox backend refused for now (rate limit, quota, capacity): retrying later may work.

    `retry_after` is the backend's hint in seconds, when it gave one.
    """

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class SandboxRateLimited(SandboxThrottled):
    """The sandbox backend refused a request for its rate (HTTP 429, "rate limit", "too many
    requests"), as opposed to quota or capacity: the fleet's jittered retry and its creation
    bucket (sandboxes/fleet.py) are the cure."""


class ClusterError(MilesEnvError):
    """The Ray cluster of a scaled-out run cannot go on (no rollout worker left, Ray unreachable)."""
