"""The run configuration of `miles-env train`: one typed config per component, composed.

A YAML (or TOML) file is validated by pydantic with unknown keys refused; CLI
overrides are dotted `key=value` pairs whose values are parsed as YAML
(`--set trainer.steps=4 --set mode=fully_async`). Errors name the field path.
"""

from __future__ import annotations

import enum
import tomllib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from miles_env.errors import ConfigError

__all__ = [
    "Mode",
    "RolloutConfig",
    "EvalConfig",
    "TrainSectionConfig",
    "RunConfig",
    "load_config",
    "apply_overrides",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Mode(enum.StrEnum):
    SYNC = "sync"  # generate a batch of groups, train, sync weights, repeat
    FULLY_ASYNC = "fully_async"  # rollouts keep going while the trainer consumes groups (bounded staleness)


class RolloutConfig(_Strict):
    group_size: int = Field(8, ge=2, description="episodes per task per GRPO group")
    groups_per_step: int = Field(4, ge=1)
    concurrency: int = Field(16, ge=1, description="episodes running at once")
    max_staleness: int = Field(1, ge=0, description="weight versions a group may lag (fully_async)")
    episode_timeout_s: float = Field(300.0, gt=0)
    tiers: list[int] | None = Field(None, description="only train on tasks whose metadata tier is listed")


class EvalConfig(_Strict):
    every: int = Field(0, ge=0, description="eval every N steps (0: only before and after training)")
    split: str = "test"
    rollouts: int = Field(4, ge=1, description="episodes per eval task")
    temperature: float | None = Field(None, ge=0.0, description="None: the harness's temperature")
    tiers: list[int] | None = None
    enabled: bool = True


class TrainSectionConfig(BaseModel):
    """Loop settings; any other key is the backend's own config (TrainerConfig fields), checked at build."""

    model_config = ConfigDict(extra="allow")

    backend: str = "torch"
    steps: int = Field(12, ge=1)
    checkpoint_every: int = Field(1, ge=1)
    keep_checkpoints: int = Field(2, ge=1)

    @property
    def backend_options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RunConfig(_Strict):
    run_dir: Path = Path("runs/default")
    seed: int = 0
    mode: Mode = Mode.SYNC
    env: str = "terminal-basics"
    harness: dict[str, Any] = Field(default_factory=lambda: {"name": "builtin"})
    engine: dict[str, Any] = Field(default_factory=lambda: {"kind": "hf", "model": "smollm2"})
    tito: dict[str, Any] = Field(default_factory=dict)
    sandbox: dict[str, Any] = Field(default_factory=lambda: {"provider": "local"})
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainSectionConfig = Field(default_factory=TrainSectionConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    weight_sync: str = Field("in_process", pattern="^(in_process|disk|delta|delta_disk)$")


def _parse_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} is not valid {path.suffix[1:] or 'YAML'}: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: the top level must be a mapping")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected key=value, e.g. trainer.steps=4")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {e}") from e
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def load_config(path: Path | None, overrides: list[str] | None = None) -> RunConfig:
    data = _parse_file(path) if path is not None else {}
    data = apply_overrides(data, overrides or [])
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"  {'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
        where = f" in {path}" if path else ""
        raise ConfigError(f"invalid config{where}:\n" + "\n".join(lines)) from e
