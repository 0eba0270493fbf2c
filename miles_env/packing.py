"""Packing sequences into batches under a token budget: one rule for the trainer's microbatches
(trainer/torch_backend.py, trainer/megatron/) and the engine's batched scoring (engines/_score.py).

Rows x the longest row <= budget, longest first to limit padding; a row longer than the budget
goes alone.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["pack_by_budget"]


def pack_by_budget(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices grouped so that rows x longest row <= budget, longest first; a longer one goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
