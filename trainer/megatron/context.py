"""Context parallelism (trainer.cp) of the megatron backend: each rank holds a part of every sequence.

GPU-only, and never run yet (no multi-GPU machine has been lent; scripts/gpu-megatron-check.sh runs
it where one is). megatron-core 0.16 runs context parallelism only in TransformerEngine's attention
(ring attention over the cp group: `DotProductAttention` refuses cp > 1), so with cp > 1 the model is
built from the TE layer spec, whose layer norms are fused into the next linear: `te_names` renames
the local spec's tensors for it (`input_layernorm.weight` <-> `self_attention.linear_qkv.layer_norm_weight`,
a dense layer's `pre_mlp_layernorm.weight` <-> `mlp.linear_fc1.layer_norm_weight`).

Concept: a microbatch is right-padded to a multiple of 2 * cp tokens and cut into 2 * cp chunks; cp
rank r takes chunks r and 2cp - 1 - r (megatron's `get_batch_on_this_cp_rank` order, which its RoPE
slicing assumes; a causal mask makes that balanced). The logits of a local position p predict token
p + 1, so each rank fills the logprob columns p + 1 of its own positions and leaves the rest 0:
`cp_logprobs` gives that partial [B, L] tensor, whose loss (the same `microbatch_loss`, the full mask
and global denominators) has exactly this rank's share of the gradient (a 0 column is a constant),
and grads summed over data x context parallel ranks are the whole sequence's. Metrics come from the
columns summed over the cp group (`cp_full`), identical on every cp rank. The load-balancing loss is
each rank's over its part of the sequence.

Invariant (checked on CPU, tests/test_moe.py): the chunks of all cp ranks tile the padded sequence
once, and every column but 0 is filled by exactly one rank.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_env.trainer.megatron.stage import StageTrainer

__all__ = ["cp_full", "cp_logprobs", "cp_positions", "te_layer_spec", "te_names"]


def cp_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions cp `rank` holds of a sequence padded to a multiple of 2 * cp, in order."""
    chunk = -(-length // (2 * cp))
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat(
        [torch.arange(first * chunk, (first + 1) * chunk), torch.arange(second * chunk, (second + 1) * chunk)]
    )


def te_names(mc: dict[str, torch.Tensor], moe: bool, to_te: bool) -> dict[str, torch.Tensor]:
    """Local-spec megatron names <-> the TE spec's (fused layer norms); `moe`: MoE layers keep a
    separate pre-MLP norm."""
    pairs = [(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")]
    if not moe:
        pairs.append((".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"))
    out = {}
    for name, t in mc.items():
        for local, te in pairs:
            src, dst = (local, te) if to_te else (te, local)
            if name.endswith(src):
                name = name[: -len(src)] + dst
                break
        out[name] = t
    return out


def cp_logprobs(tr: StageTrainer, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[B, L] logprobs of the next tokens at this cp rank's positions (their columns p + 1), 0 elsewhere,
    with the gradient of those positions; `ids` is the whole (unsplit) microbatch."""
    b, n = ids.shape
    width = -(-n // (2 * tr.cp_size)) * 2 * tr.cp_size
    padded = torch.zeros(b, width, dtype=ids.dtype, device=ids.device)
    padded[:, :n] = ids
    pos = cp_positions(width, tr.cp_size, tr.cp_rank).to(ids.device)
    local = padded[:, pos]
    # TE's causal attention with the ring over the cp group: no explicit mask; RoPE slices by cp rank
    logits: torch.Tensor = model(local, pos.unsqueeze(0).expand(b, -1), attention_mask=None)
    logits = logits.float() / tr.config.temperature  # [B, 2 * chunk, V]
    keep = pos + 1 < n  # the last position (and padding) predicts nothing
    nxt = padded[:, (pos + 1).clamp(max=width - 1)]
    picked = torch.log_softmax(logits, dim=-1).gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(b, n, dtype=picked.dtype, device=ids.device)
    out[:, (pos + 1)[keep]] = picked[:, keep]
    return out


def cp_full(tr: StageTrainer, partial: torch.Tensor) -> torch.Tensor:
    """Every column of the partial logprobs (no gradient), summed over the cp group."""
    from megatron.core import parallel_state as ps

    full = partial.detach().clone()
    torch.distributed.all_reduce(full, group=ps.get_context_parallel_group())
    return full


def te_layer_spec(shape: Any) -> Any:
    """The TransformerEngine layer spec (cp > 1 needs its attention)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    experts = shape.moe.experts if shape.moe is not None else None
    return get_gpt_layer_with_transformer_engine_spec(
        num_experts=experts, moe_grouped_gemm=False, qk_layernorm=shape.qk_norm
    )
