"""miles-env: an agentic RL environment hub.

Public surface: the core types and contracts. Plug-ins live in
`miles_env.sandboxes`, `miles_env.tito`, `miles_env.trainer`,
`miles_env.adapters` and `miles_env.engines`.
"""

from miles_env.environment import Environment, Transcript
from miles_env.errors import (
    ConfigError,
    EngineError,
    HarnessError,
    MilesEnvError,
    RegistryError,
    SandboxError,
    SandboxUnavailable,
    TaskError,
)
from miles_env.harness import Endpoint, Harness, HarnessResult
from miles_env.sandbox import Sandbox, SandboxProvider
from miles_env.types import (
    Episode,
    ExecResult,
    NetworkPolicy,
    Resources,
    Reward,
    SandboxSpec,
    Status,
    Task,
    Trajectory,
    Turn,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Endpoint",
    "EngineError",
    "Environment",
    "Episode",
    "ExecResult",
    "Harness",
    "HarnessError",
    "HarnessResult",
    "MilesEnvError",
    "NetworkPolicy",
    "RegistryError",
    "Resources",
    "Reward",
    "Sandbox",
    "SandboxError",
    "SandboxProvider",
    "SandboxSpec",
    "SandboxUnavailable",
    "Status",
    "Task",
    "TaskError",
    "Trajectory",
    "Transcript",
    "Turn",
    "__version__",
]
