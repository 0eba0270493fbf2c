"""A microbatch as tensors: the padded ids, loss mask, rollout logprobs and advantages of samples.

Concept: a trainer step packs samples (trainer/samples.py) into microbatches under a token budget;
`collate` turns one into right-padded [B, L] tensors on the trainer's device. Right padding never
reaches a real token (attention is causal), and the loss mask is 0 at padding and at position 0
(nothing predicts it). `masked_logprobs` runs an HF model's decoder and then its LM head only at the
positions that predict a mask-1 token (agentic samples are mostly prompt, and [tokens x vocab]
logits dominate time and memory). Both backends (torch, megatron) share these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles_env.trainer.samples import Sample

__all__ = ["Batch", "collate", "masked_logprobs"]


@dataclass(frozen=True, slots=True)
class Batch:
    ids: torch.Tensor  # [B, L] right-padded: causal attention never lets a real token see padding
    mask: torch.Tensor  # [B, L] float, 0 at padding and at position 0 (no prediction there)
    rollout: torch.Tensor  # [B, L]
    adv: torch.Tensor  # [B], or [B, L] when a sample has per-token advantages (OPD)
    lengths: list[int]


def masked_logprobs(model: Any, ids: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """The decoder, then the LM head at the positions that predict a mask-1 token only."""
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    sel = mask[:, 1:] > 0  # the logprob of token t comes from position t - 1
    logits = model.get_output_embeddings()(hidden[:, :-1][sel]).float() / temperature
    picked = logits.gather(-1, ids[:, 1:][sel].unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(ids.shape, dtype=logits.dtype, device=logits.device)
    out[:, 1:][sel] = picked - torch.logsumexp(logits, dim=-1)
    return out


def collate(samples: Sequence[Sample], device: torch.device) -> Batch:
    """Right-padded [B, L] tensors of `samples` on `device` (mask 0 at padding and position 0)."""
    lengths = [len(s.token_ids) for s in samples]
    b, width = len(samples), max(lengths)
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.float32)
    rollout = torch.zeros(b, width, dtype=torch.float32)
    for r, s in enumerate(samples):
        n = lengths[r]
        ids[r, :n] = torch.as_tensor(s.token_ids, dtype=torch.long)
        mask[r, :n] = torch.as_tensor(s.loss_mask, dtype=torch.float32)
        rollout[r, :n] = torch.as_tensor(s.rollout_logprobs, dtype=torch.float32)
    mask[:, 0] = 0.0
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    if any(s.token_advantages is not None for s in samples):
        adv = adv.unsqueeze(-1).repeat(1, width)
        for r, s in enumerate(samples):
            if s.token_advantages is not None:
                adv[r, : lengths[r]] = torch.as_tensor(s.token_advantages, dtype=torch.float32)
    return Batch(ids.to(device), mask.to(device), rollout.to(device), adv.to(device), lengths)
