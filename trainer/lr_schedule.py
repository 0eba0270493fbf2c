"""The learning rate of each optimizer step: linear warmup, then constant or cosine decay.

Concept: `lr_at(config, step)` is the lr of the update that takes the trainer from `step` to
`step + 1` (the update's number is n = step + 1). Warmup (`lr_warmup_steps` = W > 0): n <= W
gets lr * n / W, so the first update already moves (lr / W, not 0) and update W is the first at
the full lr. Then `lr_schedule: constant` keeps lr; `cosine` decays from lr at n = W to
`lr_min` at n = `lr_decay_steps` (the run's trainer.steps unless set) and stays there. This is
megatron-core's OptimizerParamScheduler (init_lr 0, linear warmup, cosine or constant style)
evaluated at num_steps = n; tests/test_lr_schedule.py checks it step by step against it.

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
    n, warm, peak = step + 1, config.lr_warmup_steps, config.lr
    if warm > 0 and n <= warm:
        return peak * n / warm
    if config.lr_schedule == "constant":
        return peak
    decay = config.lr_decay_steps
    if decay is None:
        raise ValueError("lr_schedule=cosine needs lr_decay_steps (the job sets the run's trainer.steps)")
    if n >= decay:
        return config.lr_min
    ratio = (n - warm) / (decay - warm)
    return config.lr_min + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (peak - config.lr_min)


def apply_lr(optimizer: Any, config: TrainerConfig, step: int) -> float:
    """Set every param group's lr (torch AdamW, megatron's DistributedOptimizer / ChainedOptimizer:
    what OptimizerParamScheduler sets too) to `lr_at(config, step)`; returns it."""
    lr = lr_at(config, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
