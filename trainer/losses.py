"""Pure loss functions of the policy-gradient step (no model, no optimizer).

Shapes: token tensors are [B, L] aligned with the input ids; position t holds the
logprob of token t given tokens < t (position 0 has no prediction and is 0).
Masks are 1 exactly where a token was sampled by the policy; every aggregate is
over mask = 1 only. Aggregation takes *global* denominators (the whole step's
token / sequence counts) so that gradient accumulation over microbatches gives
the same gradient as one large batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from miles_env.trainer.config import AdvantageKind, LossAgg

__all__ = [
    "group_advantages",
    "token_logprobs",
    "tis_weights",
    "policy_loss",
    "kl_k3",
    "aggregate",
    "MicrobatchLoss",
    "microbatch_loss",
]


def group_advantages(rewards: torch.Tensor, kind: AdvantageKind = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Advantages of one GRPO group. grpo: (r - mean) / (std + eps), std unbiased (as TRL/verl);
    dr_grpo: r - mean (no std: Dr.GRPO's length- and difficulty-unbiased variant)."""
    centred = rewards - rewards.mean()
    if kind == "dr_grpo":
        return centred
    std = rewards.std() if rewards.numel() > 1 else torch.zeros((), dtype=rewards.dtype)
    return centred / (std + eps)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, L, V] logits, [B, L] ids -> [B, L] log_softmax(logits / T) of each next token; column 0 is 0.
    logsumexp + gather, so the full [B, L, V] log-softmax is never materialised."""
    scaled = logits[:, :-1].float()
    if temperature != 1.0:
        scaled = scaled / temperature
    target = input_ids[:, 1:].unsqueeze(-1)
    picked = scaled.gather(-1, target).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return torch.nn.functional.pad(picked, (1, 0))


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Truncated importance weight min(exp(old_trainer - rollout), cap): corrects for the engine's
    sampling distribution differing from the trainer's (kernels, precision, stale weights)."""
    w = torch.exp(old_logp - rollout_logp)
    return w if cap is None else w.clamp(max=cap)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token. advantages: [B] (one per sample) or [B, L].
    Returns (token loss [B, L], clipped indicator [B, L] as float)."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    if weights is not None:
        loss = loss * weights.detach()
    return loss, (clipped < unclipped).float()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    kind: LossAgg,
    *,
    total_tokens: int,
    total_seqs: int,
    norm_tokens: int = 4096,
) -> torch.Tensor:
    """This microbatch's share of the step loss.
    token-mean: sum / total mask tokens; seq-mean-token-mean: sum_i mean_t / total seqs;
    dr_grpo: sum / (total seqs * norm_tokens)."""
    masked = values * mask
    if kind == "token-mean":
        return masked.sum() / max(total_tokens, 1)
    if kind == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / max(total_seqs, 1)
    return masked.sum() / (max(total_seqs, 1) * norm_tokens)


@dataclass(frozen=True, slots=True)
class MicrobatchLoss:
    loss: torch.Tensor  # to backpropagate: policy-gradient part (+ kl_coef * KL)
    pg: float
    kl: float
    clipped: torch.Tensor
    weights: torch.Tensor | None  # TIS weights, when tis_cap is set
    old: torch.Tensor  # logp detached: the "old" policy of this on-policy step


def microbatch_loss(
    logp: torch.Tensor,
    rollout: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None,
    cfg: Any,
    totals: dict[str, int],
) -> MicrobatchLoss:
    """One microbatch's GRPO loss, shared by every backend: PPO-clip policy loss (with TIS
    weights against the rollout logprobs), aggregated as `cfg.loss_agg`, plus k3 KL to a
    reference when there is one."""
    old = logp.detach()
    weights = tis_weights(old, rollout, cfg.tis_cap) if cfg.tis_cap is not None else None
    tok_loss, clipped = policy_loss(
        logp, old, adv, clip_low=cfg.clip_eps_low, clip_high=cfg.clip_eps_high, weights=weights
    )
    pg = aggregate(tok_loss, mask, cfg.loss_agg, **totals)
    loss, kl_value = pg, 0.0
    if ref_logp is not None:
        kl = aggregate(kl_k3(logp, ref_logp), mask, cfg.loss_agg, **totals)
        loss, kl_value = loss + cfg.kl_coef * kl, float(kl.detach())
    return MicrobatchLoss(loss, float(pg.detach()), kl_value, clipped, weights, old)
