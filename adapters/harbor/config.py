"""The part of Harbor's task.toml we act on, as typed models (harbor 0.26's TaskConfig subset).

Concept: every section allows fields we do not read (Harbor has many); those we read are typed,
so a wrong type is a one-line error naming its field (taskdir.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["HarborConfig"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow")  # Harbor has many fields we do not act on


class _Env(_Section):
    docker_image: str | None = None
    cpus: float | None = None
    memory_mb: int | None = None
    memory: str | None = None
    storage_mb: int | None = None
    storage: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    allow_internet: bool | None = None
    network_mode: str | None = Field(None, pattern="^(public|no-network|allowlist)$")


class _Phase(_Section):
    timeout_sec: float | None = Field(None, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    environment_mode: str | None = Field(None, pattern="^(shared|separate)$")  # [verifier] only
    environment: dict[str, Any] | None = None  # [verifier.environment]: implies separate
    # who runs the phase: a name or uid, `:group` optional (`docker exec -u`); None: the image's USER
    user: int | Annotated[str, Field(pattern=r"^[\w][\w.-]*(:[\w][\w.-]*)?$")] | None = None

    @property
    def user_name(self) -> str | None:
        return None if self.user is None else str(self.user)

    @property
    def separate(self) -> bool:
        """Harbor's verifier_mode: an explicit mode wins, else an environment means separate."""
        return self.environment_mode == "separate" or (
            self.environment_mode is None and self.environment is not None
        )


class _Health(_Section):
    command: str = Field(min_length=1)
    interval_sec: float = Field(5.0, ge=0)
    timeout_sec: float = Field(30.0, gt=0)
    retries: int = Field(3, ge=0)


class _StepCfg(_Section):
    name: str = Field(min_length=1, pattern=r"^[\w.-]+$")
    healthcheck: _Health | None = None
    agent: _Phase = Field(default_factory=_Phase)
    verifier: _Phase = Field(default_factory=_Phase)
    min_reward: float | dict[str, float] | None = None


class HarborConfig(_Section):
    environment: _Env = Field(default_factory=_Env)
    agent: _Phase = Field(default_factory=_Phase)
    verifier: _Phase = Field(default_factory=_Phase)
    solution: _Phase = Field(default_factory=_Phase)
    steps: list[_StepCfg] | None = None
    multi_step_reward_strategy: str | None = Field(None, pattern="^(mean|final)$")
    metadata: dict[str, Any] = Field(default_factory=dict)
