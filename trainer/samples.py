"""What one training step consumes and reports, shared by the torch and megatron backends.

Concept: `flatten_groups` turns leased GRPO groups into `Sample`s (one per Trajectory, carrying its
episode's group-normalised advantage, or per-token advantages under OPD), over each group's
policy-ended members only (trainer/groups.py: an infrastructure failure never trains, nor moves
its siblings' baseline); `pack_microbatches` packs
them under a token budget; `StepMetrics` sums a step's microbatch metrics (and, data parallel,
reduces them over ranks). Pure: no model, no optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles_env.packing import pack_by_budget
from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.groups import baseline_rewards, policy_members
from miles_env.trainer.losses import group_advantages
from miles_env.types import Episode, RoutedExperts, Trajectory

__all__ = ["Sample", "StepMetrics", "flatten_groups", "opd_token_advantages", "pack_microbatches"]


@dataclass(frozen=True, slots=True)
class Sample:
    token_ids: Sequence[int]
    loss_mask: Sequence[int]
    rollout_logprobs: Sequence[float]
    advantage: float
    reward: float
    token_advantages: Sequence[float] | None = None  # OPD: one per token (0 where the mask is 0)
    routed_experts: RoutedExperts | None = None  # MoE: the rollout's routing of each mask-1 token


def opd_token_advantages(traj: Trajectory, advantage: float, config: TrainerConfig) -> list[float]:
    """On-policy distillation: reward_weight * A + kl_weight * (teacher - rollout logprob) at each
    sampled token, i.e. minus the per-token reverse-KL estimate log pi(x) - log teacher(x)."""
    teacher = traj.teacher_logprobs
    if teacher is None:
        raise ValueError(f"opd_kl_weight={config.opd_kl_weight}: a trajectory has no teacher_logprobs")
    kl_w, r_w = config.opd_kl_weight, config.opd_reward_weight
    return [
        r_w * advantage + kl_w * (t - r) if m else 0.0
        for m, t, r in zip(traj.loss_mask, teacher, traj.logprobs, strict=True)
    ]


def flatten_groups(groups: Sequence[Sequence[Episode]], config: TrainerConfig) -> list[Sample]:
    """One Sample per Trajectory of each group's policy-ended members (`config.policy_ends`);
    advantages are computed over those members' rewards (and a TrainGroup's `baseline`
    members', which count in the baseline only). Samples with no trainable token, or (by default) with a zero advantage, are dropped: they carry
    no gradient. With token-mean aggregation this also leaves them out of the normaliser (as DAPO's
    dynamic sampling does). Under OPD (`opd_kl_weight > 0`) every sample carries per-token
    advantages (`opd_token_advantages`) and none is skipped: the teacher signal is never zero."""
    opd = config.opd_kl_weight > 0
    policy = frozenset(config.policy_ends)
    out = []
    for group in groups:
        members = policy_members(group, policy)
        if not members:
            continue
        scores = [ep.score for ep in members] + baseline_rewards(group, policy)
        rewards = torch.tensor(scores, dtype=torch.float64)
        adv = group_advantages(rewards, config.advantage, config.adv_eps).tolist()[: len(members)]
        for ep, a in zip(members, adv, strict=True):
            if config.skip_zero_advantage and a == 0.0 and config.kl_coef == 0.0 and not opd:
                continue  # with a KL term the sample still has a gradient (toward the reference)
            for traj in ep.samples:
                if any(traj.loss_mask[1:]):
                    tok = opd_token_advantages(traj, float(a), config) if opd else None
                    out.append(Sample(traj.token_ids, traj.loss_mask, traj.logprobs, float(a), ep.score, tok,
                                      traj.routed_experts))  # fmt: skip
    return out


pack_microbatches = pack_by_budget  # the trainer's name for it (megatron, tests)


class StepMetrics:
    """A step's running sums over its microbatches (every backend's): losses, clipped and TIS
    weights and |trainer - rollout| logprob gaps over mask-1 tokens, and the tokens run."""

    def __init__(self) -> None:
        self.pg = self.kl = self.clip = self.tis = self.diff_sum = self.diff_max = 0.0
        self.mask_tokens = self.tokens = 0

    def add(
        self,
        pg: float,
        kl: float,
        clipped: torch.Tensor,
        tis: torch.Tensor | None,
        diff: torch.Tensor,
        mask: torch.Tensor,
        tokens: int = 0,
    ) -> None:
        on = mask.bool()
        self.tokens += tokens
        self.pg += pg
        self.kl += kl
        self.clip += float(clipped[on].sum())
        self.tis += float(tis[on].sum()) if tis is not None else float(on.sum())
        d = diff[on].abs()
        self.diff_sum += float(d.sum())
        self.diff_max = max(self.diff_max, float(d.max()) if d.numel() else 0.0)
        self.mask_tokens += int(on.sum())

    def reduce(self, device: torch.device) -> None:
        """Sum (max for diff_max) over the ranks of a data-parallel step: what one process would see.
        Collective: every rank of the default process group must call it."""
        from miles_env.trainer.fsdp import reduce_metrics

        sums = [self.pg, self.kl, self.clip, self.tis, self.diff_sum, self.mask_tokens, self.tokens]
        (self.pg, self.kl, self.clip, self.tis, self.diff_sum, mask_tokens, tokens), (self.diff_max,) = (
            reduce_metrics(sums, [self.diff_max], device)
        )
        self.mask_tokens, self.tokens = round(mask_tokens), round(tokens)
