"""The learning rate of each optimizer step: linear warmup, then constant or cosine decay.

Concept: `lr_at(config, step)` is the lr of the update that takes the trainer from `step` to
`step + 1` (`step` updates were taken before it). Warmup (`lr_warmup_steps` = W > 0): update
`step` < W gets lr * (step + 1) / W, so the first update already moves (lr / W, not 0) and update
W - 1 is the first at the full lr. Then `lr_schedule: constant` keeps lr; `cosine` decays from lr
at step W to `lr_min` at step `lr_decay_steps` (the run's trainer.steps unless set: its last
update, step trainer.steps - 1, still moves) and stays there. This is megatron-core's
OptimizerParamScheduler (init_lr 0, linear warmup, cosine or constant style) as its training loop
uses it (the update after `step` steps runs at num_steps = step), with the warmup one step
ahead (num_steps = step + 1); tests/test_lr_schedule.py checks it step by step against it.

Invariant: stateless, a function of the trainer's step alone, so a resumed trainer (whose step is
restored) continues the schedule exactly, with nothing new in its checkpoint, and the torch and
megatron backends (which share `apply_lr`, called before each step) follow one schedule.
"""

from __future__ import annotations

import math
from typing import Any

from miles_env.trainer.config import TrainerConfig

__all__ = ["apply_lr", "lr_at"]


def lr_at(config: TrainerConfig, step: int) -> float:
    """The lr of the update from `step` to `step + 1` (module docstring)."""
    warm, peak = config.lr_warmup_steps, config.lr
    if step < warm:
        return peak * (step + 1) / warm
    if config.lr_schedule == "constant":
        return peak
    decay = config.lr_decay_steps
    if decay is None:
        raise ValueError("lr_schedule=cosine needs lr_decay_steps (the job sets the run's trainer.steps)")
    if step >= decay:
        return config.lr_min
    ratio = (step - warm) / (decay - warm)
    return config.lr_min + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (peak - config.lr_min)


def apply_lr(optimizer: Any, config: TrainerConfig, step: int) -> float:
    """Set every param group's lr (torch AdamW, megatron's DistributedOptimizer / ChainedOptimizer:
    what OptimizerParamScheduler sets too) to `lr_at(config, step)`; returns it."""
    lr = lr_at(config, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
