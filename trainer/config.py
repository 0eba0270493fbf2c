"""TrainerConfig: every knob of the policy-gradient step, validated once.

The defaults are GRPO with PPO clipping, truncated importance sampling against
the rollout logprobs, no KL term, fp32, and a token budget per microbatch. With
`opd_kl_weight > 0` (on-policy distillation) the advantage is per token.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from miles_env.types import POLICY_ENDS, EpisodeEnd

__all__ = ["TrainerConfig", "LoraConfig", "LossAgg", "AdvantageKind"]

LossAgg = Literal["token-mean", "seq-mean-token-mean", "dr_grpo"]
AdvantageKind = Literal["grpo", "dr_grpo"]


class LoraConfig(BaseModel):
    """`trainer.lora`: train low-rank adapters only (PEFT LoRA on `target_modules`); see trainer/lora.py.
    dropout > 0 makes the training forward stochastic, so logprob_diff_* then measures dropout too."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(8, ge=1)
    alpha: int = Field(16, gt=0, description="the update is scaled by alpha / rank (PEFT takes an int)")
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), min_length=1
    )
    target_parameters: tuple[str, ...] = Field(
        (),
        description="parameters adapted directly (PEFT's target_parameters): a MoE's fused experts, "
        "e.g. mlp.experts.gate_up_proj, mlp.experts.down_proj (one low-rank pair per expert)",
    )


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(1e-6, gt=0)
    # the lr of each step (trainer/lr_schedule.py): linear warmup, then constant or cosine to lr_min
    lr_warmup_steps: int = Field(0, ge=0, description="steps of linear warmup from lr / W to lr; 0 = none")
    lr_schedule: Literal["constant", "cosine"] = "constant"
    lr_min: float = Field(0.0, ge=0, description="cosine: the lr at lr_decay_steps and after")
    lr_decay_steps: int | None = Field(
        None, ge=1, description="cosine: the step it reaches lr_min (miles-env train: trainer.steps)"
    )
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.0, ge=0)
    adam_eps: float = Field(1e-8, gt=0)
    fused_adamw: bool = True  # torch's fused AdamW kernel: ~8x faster step than the per-tensor loop on CPU
    clip_eps_low: float = Field(0.2, ge=0)
    clip_eps_high: float = Field(0.2, ge=0)  # > clip_eps_low is DAPO's "clip higher"
    loss_agg: LossAgg = "token-mean"
    advantage: AdvantageKind = "grpo"  # grpo: (r - mean) / (std + eps); dr_grpo: r - mean
    adv_eps: float = Field(1e-6, gt=0)
    loss_norm_tokens: int = Field(4096, ge=1, description="dr_grpo's constant normaliser (tokens per sample)")
    tis_cap: float | None = Field(2.0, gt=0, description="truncated importance sampling cap; None = off")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the frozen initial model; 0 = no reference model")
    max_tokens_per_microbatch: int = Field(4096, ge=1, description="padded tokens per forward/backward")
    grad_clip: float | None = Field(1.0, gt=0)
    temperature: float = Field(1.0, gt=0, description="logprobs are log_softmax(logits / T), as the engine")
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "auto"  # "auto" = cuda when available, else cpu
    seed: int = 0
    keep_checkpoints: int = Field(2, ge=1)
    # on-policy distillation (miles_env/opd.py sets both from the run's `opd` section): a trajectory's
    # token t gets the advantage opd_reward_weight * A_grpo + opd_kl_weight * (teacher_t - rollout_t)
    opd_kl_weight: float = Field(0.0, ge=0, description="weight of the teacher signal; 0 = plain GRPO")
    opd_reward_weight: float = Field(1.0, ge=0, description="weight of the GRPO advantage under OPD")
    skip_zero_advantage: bool = Field(
        True, description="drop samples whose advantage is 0 (groups with one reward): no gradient, all cost"
    )
    lora: LoraConfig | None = Field(None, description="train LoRA adapters only; None = every weight")
    policy_ends: tuple[EpisodeEnd, ...] = Field(
        tuple(sorted(POLICY_ENDS)),
        min_length=1,
        description="end classes that train with their score; every other one (infrastructure) never "
        "trains nor counts in a baseline (trainer/groups.py)",
    )
    moe_aux_loss_coef: float | None = Field(
        None,
        ge=0,
        description="MoE load-balancing loss weight (trainer/moe.py); None = the model config's "
        "router_aux_loss_coef, 0 = off (still logged)",
    )

    @model_validator(mode="after")
    def _clip_range(self) -> TrainerConfig:
        if self.clip_eps_low >= 1.0:
            raise ValueError(f"clip_eps_low={self.clip_eps_low}: must be < 1")
        return self

    @model_validator(mode="after")
    def _lr_schedule(self) -> TrainerConfig:
        if self.lr_schedule == "constant":
            return self
        if self.lr_decay_steps is None:
            raise ValueError("lr_schedule=cosine needs lr_decay_steps (miles-env train sets trainer.steps)")
        if self.lr_decay_steps <= self.lr_warmup_steps:
            msg = f"lr_decay_steps={self.lr_decay_steps} must be more than lr_warmup_steps={self.lr_warmup_steps}"
            raise ValueError(msg)
        if self.lr_min > self.lr:
            raise ValueError(f"lr_min={self.lr_min} is more than lr={self.lr}")
        return self
