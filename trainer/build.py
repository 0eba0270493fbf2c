"""Build a trainer backend by name: `trainer.backend` (torch | megatron) plus its options.

Concept: the backends are a `PluginTable` (name -> trainer class), imported only when built,
so this module and `miles_env.trainer` stay free of torch and megatron-core. Each backend class
names the pydantic config it takes (`config_type`); the options are validated against it once.

Errors: an unknown backend is a ConfigError listing the known ones; a bad option is a ConfigError
naming `trainer.<field>`, the key the user wrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from miles_env.errors import ConfigError
from miles_env.plugins import PluginTable
from miles_env.trainer.loop import TrainerBackend

__all__ = ["BACKENDS", "build_trainer"]

BACKENDS = PluginTable(
    "trainer backend",
    {
        "torch": "miles_env.trainer.torch_backend:TorchTrainer",
        "megatron": "miles_env.trainer.megatron.backend:MegatronTrainer",
    },
)


def build_trainer(backend: str, model_path: Path, options: Mapping[str, Any]) -> TrainerBackend:
    """The `backend` trainer on `model_path`, its config built from `options` (TrainerConfig fields
    and the backend's own, e.g. megatron's tp/pp)."""
    cls = BACKENDS.load(backend)  # an unknown name is a ConfigError before anything is imported
    try:
        config = cls.config_type(**options)
    except ValidationError as e:
        fields = "; ".join(f"trainer.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"invalid trainer config: {fields}") from e
    trainer: TrainerBackend = cls(model_path, config)
    return trainer
