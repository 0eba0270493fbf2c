"""The megatron backend's parallel layout, tp x pp x cp x ep x dp, checked before anything is built.

Concept: megatron-core's parallel_state lays a world of ranks out as tp * cp * dp * pp (tensor,
context, data, pipeline); expert parallelism (ep) re-cuts the tp * cp * dp ranks of each stage for
the MoE layers, so with tp = 1 the experts are sharded over ep ranks drawn from the data x context
parallel ones (ep = 2 on 2 ranks: data parallel 2 for the dense weights, each rank holding half
of every layer's experts). `check_layout` refuses, in one line naming the fields, every layout
that cannot run: a world the sizes do not divide, heads or key-value heads not divisible by tp,
layers by pp, experts by ep, ep on a dense model, and what this backend does not run (MoE with
tp > 1: megatron trains MoE under tensor parallelism only with sequence parallelism; context
parallelism without CUDA and TransformerEngine, whose attention is the only one megatron-core
0.16 runs it in).

Lifecycle: `check_layout(cfg, world_size(), shape)` in MegatronTrainer's constructor, before the
process groups.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from miles_env.errors import ConfigError

__all__ = ["check_layout", "world_size"]


def world_size() -> int:
    """The ranks this trainer will run on: the process group's, else torchrun's WORLD_SIZE, else 1."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _cp_needs() -> str | None:
    """Why context parallelism cannot run here; None when it can."""
    if not torch.cuda.is_available():
        return ("needs GPUs: megatron-core 0.16 runs context parallelism only in TransformerEngine's "
                "attention (CUDA), and this machine has none")  # fmt: skip
    if importlib.util.find_spec("transformer_engine") is None:
        return (
            "needs TransformerEngine (pip install transformer_engine[pytorch]): megatron-core's CP attention"
        )
    return None


def check_layout(cfg: Any, world: int, shape: Any) -> None:
    """Refuse an impossible or unsupported tp x pp x cp x ep x dp layout for `shape` on `world` ranks
    (a ConfigError of one line naming the trainer fields)."""
    tp, pp, cp, ep = cfg.tp, cfg.pp, cfg.cp, cfg.ep
    if world % (tp * pp * cp):
        raise ConfigError(f"trainer.tp x pp x cp = {tp} x {pp} x {cp} does not divide the world of {world} "
                          f"rank{'s' * (world != 1)} (data parallel = world / (tp x pp x cp))")  # fmt: skip
    dp = world // (tp * pp * cp)
    if shape.heads % tp or shape.groups % tp:
        raise ConfigError(f"trainer.tp={tp} does not divide the model's {shape.heads} attention heads "
                          f"and {shape.groups} key-value heads")  # fmt: skip
    if shape.layers % pp:
        raise ConfigError(f"trainer.pp={pp} does not divide the model's {shape.layers} layers")
    if cp > 1 and (why := _cp_needs()) is not None:
        raise ConfigError(f"trainer.cp={cp} {why}")
    if cp > 1 and pp > 1:
        raise ConfigError(
            f"trainer.cp={cp} with trainer.pp={pp}: context parallelism across pipeline stages is not written yet"
        )
    if shape.moe is None:
        if ep > 1:
            raise ConfigError(
                f"trainer.ep={ep}: the model has no experts (expert parallelism is for MoE models)"
            )
        return
    if shape.moe.experts % ep:
        raise ConfigError(f"trainer.ep={ep} does not divide the model's {shape.moe.experts} experts")
    if (dp * cp) % ep:
        raise ConfigError(f"trainer.ep={ep} does not divide data x context parallel = {dp} x {cp} "
                          f"(world {world} / (tp x pp) = {world // (tp * pp)}): experts are sharded over those ranks")  # fmt: skip
    if tp > 1:
        raise ConfigError(f"trainer.tp={tp} with a MoE model needs sequence parallelism, which this "
                          "backend does not run: shard the experts with trainer.ep instead")  # fmt: skip
