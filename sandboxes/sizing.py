"""A sandbox's size and lifetime as a cloud backend is asked for them, from its task's limits.

Concept: every cloud provider (daytona, modal, e2b, agentenv) maps the same four
numbers onto its SDK's own sizing arguments: cpus (the task's `Resources.cpus`, else
the provider's configured default), memory and disk in MB, and the lifetime (the
backend's own TTL), which is never shorter than agent timeout + verifier timeout +
setup margin (miles_env/limits.py), so a backend never stops a sandbox whose episode
may still be running. Shared here, beside the providers, so none imports another's.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_env.limits import sandbox_lifetime_s
from miles_env.types import SandboxSpec

__all__ = ["Sizing", "sizing"]


@dataclass(frozen=True, slots=True)
class Sizing:
    cpus: float
    memory_mb: int
    disk_mb: int
    lifetime_s: float


def sizing(spec: SandboxSpec, default_cpus: float, ttl_s: float) -> Sizing:
    """The size of `spec`'s sandbox: the task's values, the provider's `default_cpus` where the task
    names none, and a lifetime of at least `ttl_s` (the provider's configured TTL)."""
    res = spec.resources
    return Sizing(
        cpus=res.cpus if res.cpus is not None else default_cpus,
        memory_mb=res.memory_mb,
        disk_mb=res.disk_mb,
        lifetime_s=sandbox_lifetime_s(res, ttl_s),
    )
