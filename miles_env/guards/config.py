"""The `guards:` section of the run config: which reward-hacking detectors run, and what they cost.

Concept: a detector names a flag (`test_edit`, `git_history`, `package_install`); a flag found in
an episode is stored on `Episode.flags`, and a flag listed in `zero_reward_on` sets that episode's
reward to 0 (the original score is kept in `Reward.details["guards"]`). `verify_in` overrides the
environment's own choice of where verify runs (`Environment.verify_in`); `env` keeps it.

Invariant: pydantic only (the run config composes it); unknown flags fail at load with their path.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["FLAGS", "GuardsConfig"]

# flag name -> what it means (one line each, shown by `env eval` and the docs)
FLAGS: dict[str, str] = {
    "test_edit": "a protected path (the task's tests) differs from its starting content",
    "git_history": "a command reached for git history or objects outside the starting state",
    "package_install": "a command tried to install a package or download something",
}


class GuardsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    detectors: list[str] = Field(default_factory=lambda: list(FLAGS), description="flags to look for")
    zero_reward_on: list[str] = Field(
        default_factory=lambda: ["test_edit"], description="flags that set the episode's reward to 0"
    )
    restore_protected: bool = Field(
        True, description="rewrite protected files to their starting content before verify"
    )
    verify_in: Literal["env", "same", "fresh"] = Field(
        "env", description="env: the environment's verify_in; same: the agent's sandbox; fresh: a new one"
    )

    @field_validator("detectors", "zero_reward_on")
    @classmethod
    def _known(cls, names: list[str]) -> list[str]:
        unknown = sorted(set(names) - set(FLAGS))
        if unknown:
            raise ValueError(f"unknown flags {unknown}; known: {', '.join(FLAGS)}")
        return names
