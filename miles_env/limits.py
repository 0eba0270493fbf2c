"""Per-task limits: what a task declares, tightened by the run, and how long its sandbox must live.

Concept: a task declares its own limits in `SandboxSpec.resources` (cpus, memory, disk,
processes, agent and verifier timeouts) and `SandboxSpec.network`; Harbor's task.toml and
`make_task` both fill those fields. A run may set `rollout.limits` (a `LimitsOverride`),
which can only TIGHTEN: each field set there replaces the task's value only when it is
stricter (a smaller number, or a network earlier in NetworkPolicy's order: `none`, then
`public`, then `host`; so `none` forbids every network a task asks for). A looser value is ignored
with a logged note, never an error: one run config serves tasks of very different sizes,
so "at most 2 cpus" must not fail the task that asks for 1.

Invariant: `effective_spec(spec, override)` is never looser than `spec` on any field, and
every provider reads only the effective spec. The rollout bounds the agent phase by
`agent_timeout_s` (and the run's episode timeout, whichever is tighter) and verify() by
`verifier_timeout_s`; a sandbox's lifetime/TTL is at least `sandbox_lifetime_s`, so no
reaper or backend TTL removes it while its episode may still be running.
"""

from __future__ import annotations

import logging
import re

from pydantic import BaseModel, ConfigDict, Field

from miles_env.errors import ConfigError
from miles_env.types import NetworkPolicy, Resources, SandboxSpec

__all__ = [
    "LimitsOverride",
    "TaskLimits",
    "declare",
    "effective_spec",
    "agent_timeout_s",
    "verifier_timeout_s",
    "sandbox_lifetime_s",
    "parse_size_mb",
    "DEFAULT_VERIFIER_TIMEOUT_S",
    "SETUP_MARGIN_S",
]

_log = logging.getLogger(__name__)

DEFAULT_VERIFIER_TIMEOUT_S = 600.0  # Harbor's own default for [verifier] timeout_sec
SETUP_MARGIN_S = 900.0  # sandbox creation, environment setup and tear-down, beyond agent + verifier
_NUMERIC = (
    "cpus",
    "memory_mb",
    "max_procs",
    "cpu_seconds",
    "disk_mb",
    "timeout_s",
    "agent_timeout_s",
    "verifier_timeout_s",
)

_STRICTNESS = list(NetworkPolicy)  # declared from the strictest (types.py)


class LimitsOverride(BaseModel):
    """`rollout.limits`: run-level ceilings over every task's own limits (None = the task's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpus: float | None = Field(None, gt=0)
    memory_mb: int | None = Field(None, gt=0)
    max_procs: int | None = Field(None, gt=0)
    cpu_seconds: int | None = Field(None, gt=0)
    disk_mb: int | None = Field(None, gt=0)
    timeout_s: float | None = Field(None, gt=0, description="per-exec wall-clock default")
    agent_timeout_s: float | None = Field(None, gt=0)
    verifier_timeout_s: float | None = Field(None, gt=0)
    network: NetworkPolicy | None = Field(
        None, description="'none' forbids a task's network; 'public' turns a task's 'host' into 'public'"
    )


class TaskLimits(BaseModel):
    """What a task may declare (`make_task(limits=...)`, Harbor's task.toml): sizes as MB or '2G'."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpus: float | None = Field(None, gt=0)
    memory_mb: int | str | None = None
    disk_mb: int | str | None = None
    max_procs: int | None = Field(None, gt=0)
    agent_timeout_s: float | None = Field(None, gt=0)
    verifier_timeout_s: float | None = Field(None, gt=0)
    network: NetworkPolicy | None = None


def declare(spec: SandboxSpec, limits: TaskLimits) -> SandboxSpec:
    """`spec` carrying the task's declared limits (unset ones keep `spec`'s values)."""
    changes: dict[str, object] = {}
    for name in ("cpus", "max_procs", "agent_timeout_s", "verifier_timeout_s"):
        if (value := getattr(limits, name)) is not None:
            changes[name] = value
    for name in ("memory_mb", "disk_mb"):
        if (size := getattr(limits, name)) is not None:
            changes[name] = parse_size_mb(size, name)
    resources = Resources.model_validate({**spec.resources.model_dump(), **changes})
    update: dict[str, object] = {"resources": resources}
    if limits.network is not None:
        update["network"] = limits.network
    return spec.model_copy(update=update)


def effective_spec(spec: SandboxSpec, override: LimitsOverride | None) -> SandboxSpec:
    """`spec` with each limit of `override` applied where it is stricter; looser ones are logged."""
    if override is None:
        return spec
    res = spec.resources
    changes: dict[str, float | int] = {}
    for name in _NUMERIC:
        ceiling = getattr(override, name)
        if ceiling is None:
            continue
        declared = getattr(res, name)
        if declared is None or ceiling < declared:
            changes[name] = ceiling
        elif ceiling > declared:
            _log.info(
                "rollout.limits.%s=%g is looser than the task's %g: the task's holds", name, ceiling, declared
            )
    update: dict[str, object] = {"resources": res.model_copy(update=changes)} if changes else {}
    if override.network is not None and _STRICTNESS.index(override.network) < _STRICTNESS.index(spec.network):
        update["network"] = override.network
    elif override.network is not None and override.network is not spec.network:
        _log.info(
            "rollout.limits.network=%s is looser than the task's %s: the task's holds",
            override.network,
            spec.network,
        )
    return spec.model_copy(update=update) if update else spec


def agent_timeout_s(res: Resources, episode_timeout_s: float) -> float:
    """The agent phase's wall time: the task's agent timeout or the run's, whichever is tighter."""
    return episode_timeout_s if res.agent_timeout_s is None else min(res.agent_timeout_s, episode_timeout_s)


def verifier_timeout_s(res: Resources, default_s: float = DEFAULT_VERIFIER_TIMEOUT_S) -> float:
    return default_s if res.verifier_timeout_s is None else res.verifier_timeout_s


def sandbox_lifetime_s(res: Resources, floor_s: float, *, margin_s: float = SETUP_MARGIN_S) -> float:
    """How long a sandbox for `res` may live: at least agent + verifier + setup margin, never less
    than `floor_s` (the provider's configured TTL)."""
    if res.agent_timeout_s is None and res.verifier_timeout_s is None:
        return floor_s
    needed = (res.agent_timeout_s or 0.0) + verifier_timeout_s(res) + margin_s
    return max(floor_s, needed)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?\s*$", re.IGNORECASE)
_UNIT_MB = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}


def parse_size_mb(value: int | float | str, field: str) -> int:
    """A size in MB: a number is MB already; a string takes K/M/G/T (Harbor's memory = "2G")."""
    if isinstance(value, bool):
        raise ConfigError(f"{field}={value!r}: expected a size such as 2048 or '2G'")
    if isinstance(value, int | float):
        return max(1, round(value))
    m = _SIZE.match(value)
    if m is None:
        raise ConfigError(f"{field}={value!r}: expected a size such as 2048 or '2G'")
    unit = (m.group(2) or "M").upper().rstrip("I")  # a bare number is MB, like the int form
    return max(1, round(float(m.group(1)) * _UNIT_MB[unit]))
