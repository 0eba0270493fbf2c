"""StageTrainer: what the megatron backend's helper modules need of the trainer that calls them.

backend.py's MegatronTrainer passes itself to parallel, grads, batches, context and checkpoint; they
see it through this Protocol, so none of them imports the backend that imports them (no import
circle, type-only ones included).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch

from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.megatron.convert import ModelShape
from miles_env.trainer.moe import MoeAux
from miles_env.trainer.samples import Sample

__all__ = ["StageTrainer"]


class StageTrainer(Protocol):
    shape: ModelShape
    device: torch.device
    model: Any
    ref_model: Any
    ddp: Any
    optimizer: Any
    moe: MoeAux | None
    model_path: Path
    step: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    ep_rank: int
    ep_size: int
    cp_rank: int
    cp_size: int
    layer_offset: int

    @property
    def config(self) -> TrainerConfig: ...

    def logits(self, ids: torch.Tensor, model: torch.nn.Module | None = None) -> torch.Tensor: ...

    def _forward_logprobs(
        self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def _collate(self, samples: Sequence[Sample]) -> Any: ...

    def _clip_and_step(self) -> float: ...

    def _moe_tap(self, batch: Any, real: bool = True) -> AbstractContextManager[Any]: ...
