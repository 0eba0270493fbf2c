"""A rank's microbatches for one megatron step: its share, fillers, one shape where comms need it.

Concept: a step's samples are packed into microbatches once (the same packing on every rank and in
a single process) and dealt round-robin over data-parallel ranks. Expert parallelism makes every
MoE layer's forward and backward a collective over the ep ranks, so each of them must run as many
microbatches as the busiest: the short ones run zero-weight fillers (all padding, loss mask 0,
no real token: no loss, no gradient, no metric, no aux). megatron's all-gather token dispatcher
(MoE on CPU, over gloo) also needs every rank's microbatch to hold the same number of tokens, and
refuses variable sequence lengths, so with ep > 1 or pp > 1 it gets every microbatch of the step
right-padded to the step's largest [rows, width] (padding never reaches a real token: attention is
causal, no expert has a capacity, and the aux loss counts real tokens only).

Invariant: the real microbatches are exactly those of the single process, so the summed gradient
over ranks is the single process's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from miles_env.trainer.batch import Batch
from miles_env.trainer.megatron.stage import StageTrainer
from miles_env.trainer.torch_backend import Sample

__all__ = ["all_gather_dispatch", "one_shape", "step_batches", "uniform_microbatches"]


def all_gather_dispatch(shape: Any) -> bool:
    """A MoE model on CPU: megatron's all-gather token dispatcher (the all-to-all one needs CUDA)."""
    return shape.moe is not None and not torch.cuda.is_available()


def uniform_microbatches(shape: Any, pp: int, ep: int) -> bool:
    """Whether every microbatch of a step must have one shape (all-gather dispatch across ranks, or
    its fixed pipeline p2p shapes)."""
    return all_gather_dispatch(shape) and (pp > 1 or ep > 1)


def _pad(b: Batch, rows: int, width: int) -> Batch:
    """`b` right-padded to [rows, width] with padding tokens (id 0, mask 0, advantage 0)."""
    r, w = b.ids.shape
    if (r, w) == (rows, width):
        return b

    def grow(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 1:  # a per-row advantage
            row = t.new_zeros(rows)
            row[:r] = t
            return row
        out = t.new_zeros(rows, width)
        out[:r, :w] = t
        return out

    return Batch(grow(b.ids), grow(b.mask), grow(b.rollout), grow(b.adv), [*b.lengths, *[0] * (rows - r)])


def _filler(rows: int, width: int, device: torch.device) -> Batch:
    zeros = torch.zeros(rows, width, device=device)
    return Batch(zeros.long(), zeros, zeros.clone(), torch.zeros(rows, device=device), [0] * rows)


def one_shape(tr: StageTrainer, batches: list[Batch]) -> list[Batch]:
    """`batches` padded to their largest [rows, width] where comms need one shape (else as they are)."""
    if not batches or not uniform_microbatches(tr.shape, tr.pp_size, tr.ep_size):
        return batches
    rows, width = max(b.ids.shape[0] for b in batches), max(b.ids.shape[1] for b in batches)
    return [_pad(b, rows, width) for b in batches]


def step_batches(
    tr: StageTrainer, samples: Sequence[Sample], mbs: Sequence[Sequence[int]]
) -> tuple[list[Batch], list[bool]]:
    """This data-parallel rank's microbatches of `mbs` (global sample indices) and which are real."""
    mine = [tr._collate([samples[i] for i in idx]) for idx in mbs[tr.dp_rank :: tr.dp_size]]
    real = [True] * len(mine)
    rows = max((len(idx) for idx in mbs), default=1)
    width = max((len(samples[i].token_ids) for idx in mbs for i in idx), default=1)
    if tr.ep_size > 1:  # each forward is a collective over the ep ranks: as many as the busiest
        most = -(-len(mbs) // tr.dp_size)
        mine += [_filler(rows, width, tr.device) for _ in range(most - len(mine))]
        real += [False] * (most - len(real))
    if uniform_microbatches(tr.shape, tr.pp_size, tr.ep_size):
        mine = [_pad(b, rows, width) for b in mine]
    return mine, real
