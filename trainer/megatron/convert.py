"""HF Llama/Qwen (dense, Qwen2-MoE, Qwen3-MoE) <-> megatron-core GPTModel: config and weights, both ways.

Concept: one naming/layout map between an HF causal LM (`model.layers.N.self_attn.q_proj`, ...)
and megatron-core's local-spec GPTModel (`decoder.layers.N.self_attention.linear_qkv`, ...).
Megatron fuses q/k/v into one matrix interleaved per query group ([q heads of group g, k_g, v_g]
for each g) and gate/up into one `linear_fc1` ([gate; up]); both are pure reshapes, so
HF -> megatron -> HF is bit-exact.

Tensor parallel: `shard(name, full, rank, size)` cuts a full megatron tensor into this rank's
piece and `unshard` glues the pieces back (column-parallel on dim 0, row-parallel on dim 1,
fc1 per half so each rank keeps [gate_r; up_r]). Pipeline parallel: `layer_offset` maps a
stage's local layer numbers to global ones (parallel.py builds each stage with it). MoE layers
(router, experts, shared expert) are mapped by `megatron.experts`, in the HF model layout
(fused experts; `miles_env.weight_layout` converts from and to the checkpoint files' layout).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from miles_env.trainer.megatron.experts import moe_layer_to_hf, moe_layer_to_megatron
from miles_env.trainer.moe import MoeShape, moe_shape

__all__ = [
    "ModelShape",
    "model_shape",
    "transformer_config",
    "hf_to_megatron",
    "megatron_to_hf",
    "shard",
    "unshard",
    "COLUMN_PARALLEL",
    "ROW_PARALLEL",
]

_MC = "decoder.layers.{}."
_HF = "model.layers.{}."
# megatron suffix <- HF suffix, for tensors that map one to one inside a layer
_PLAIN = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
COLUMN_PARALLEL = (
    "linear_qkv.weight",
    "linear_qkv.bias",
    "linear_fc1.weight",
    "word_embeddings.weight",
    "output_layer.weight",
)
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    rope_theta: float
    max_positions: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    moe: MoeShape | None = None  # every decoder layer's MLP is a MoE layer; None: dense


_KINDS = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe")


def model_shape(hf_config: Any) -> ModelShape:
    """Read the shape of a Llama / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE HF config."""
    kind = getattr(hf_config, "model_type", "")
    if kind not in _KINDS:
        raise ValueError(f"model_type={kind!r}: the megatron backend converts {', '.join(_KINDS)}")
    moe = moe_shape(hf_config) if kind.endswith("_moe") else None
    if moe is not None and (
        getattr(hf_config, "mlp_only_layers", None) or int(getattr(hf_config, "decoder_sparse_step", 1)) != 1
    ):
        raise ValueError(f"model_type={kind!r}: dense layers among MoE ones (mlp_only_layers, "
                         "decoder_sparse_step) are not converted yet: every layer must be a MoE layer")  # fmt: skip
    heads = int(hf_config.num_attention_heads)
    rope = getattr(hf_config, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0)
    return ModelShape(
        layers=int(hf_config.num_hidden_layers),
        hidden=int(hf_config.hidden_size),
        heads=heads,
        groups=int(getattr(hf_config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
        ffn=int(hf_config.intermediate_size),
        vocab=int(hf_config.vocab_size),
        eps=float(hf_config.rms_norm_eps),
        rope_theta=theta,
        max_positions=int(hf_config.max_position_embeddings),
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=kind in ("qwen2", "qwen2_moe") or bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        moe=moe,
    )


def transformer_config(shape: ModelShape, dtype: torch.dtype, **overrides: Any) -> Any:
    """megatron TransformerConfig for `shape`: RMSNorm, SwiGLU, RoPE, no dropout, no fused kernels
    (they need CUDA), weights created on the CPU (the converted HF weights overwrite them)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.groups,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=shape.eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    if shape.moe is not None:
        kwargs.update(moe_config(shape.moe))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def moe_config(m: MoeShape) -> dict[str, Any]:
    """megatron's MoE fields for an HF MoE: SequentialMLP experts (no grouped GEMM), the HF top-k
    (Qwen3-MoE's renormalised top-k = top-k of the logits then softmax; Qwen2-MoE's = softmax, then
    top-k), megatron's own aux loss off (trainer/moe.py computes the same one for both backends),
    the all-to-all token dispatcher on GPUs and the all-gather one on CPU (gloo; no CUDA streams)."""
    return dict(
        num_moe_experts=m.experts, moe_ffn_hidden_size=m.ffn, moe_router_topk=m.top_k,
        moe_router_pre_softmax=not m.norm_topk, moe_router_score_function="softmax",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
        moe_shared_expert_intermediate_size=m.shared_ffn or None, moe_shared_expert_gate=m.shared_ffn > 0,
    )  # fmt: skip


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: ModelShape) -> torch.Tensor:
    per = s.heads // s.groups
    tail = q.shape[1:]
    parts = (q.reshape(s.groups, per * s.head_dim, *tail), k.reshape(s.groups, s.head_dim, *tail),
             v.reshape(s.groups, s.head_dim, *tail))  # fmt: skip
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _split_qkv(qkv: torch.Tensor, s: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per = s.heads // s.groups
    tail = qkv.shape[1:]
    g = qkv.reshape(s.groups, (per + 2) * s.head_dim, *tail)
    q, k, v = torch.split(g, [per * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_megatron(hf: Mapping[str, torch.Tensor], s: ModelShape, layer_offset: int = 0,
                   num_layers: int | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Full (unsharded) megatron tensors of layers [offset, offset + num_layers), plus embedding,
    final norm and output layer (untied only)."""
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not s.tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for local in range(s.layers if num_layers is None else num_layers):
        mc, h = _MC.format(local), _HF.format(local + layer_offset)
        for mc_name, hf_name in _PLAIN.items():
            if h + hf_name in hf:
                out[mc + mc_name] = hf[h + hf_name]
        a = h + "self_attn."
        out[mc + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], s
        )
        if s.qkv_bias:
            out[mc + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], s
            )
        if s.moe is not None:
            out.update(moe_layer_to_megatron(hf, h, mc, s.moe.experts))
            continue
        out[mc + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]]
        )
    return out


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def megatron_to_hf(
    mc: Mapping[str, torch.Tensor], s: ModelShape, layer_offset: int = 0
) -> dict[str, torch.Tensor]:
    """HF-named tensors from full megatron tensors. Tied models get `lm_head.weight` as the very
    same tensor as the embedding (as an HF model's state_dict has it)."""
    out: dict[str, torch.Tensor] = {}
    moe_parts: dict[str, dict[str, torch.Tensor]] = {}  # HF layer prefix -> its MoE tensors
    for name, t in mc.items():
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        elif name == "output_layer.weight":
            out["lm_head.weight"] = t
        elif m := _LAYER.fullmatch(name):
            h = _HF.format(int(m.group(1)) + layer_offset)
            rest = m.group(2)
            if rest in _PLAIN:
                out[h + _PLAIN[rest]] = t
            elif rest.startswith("self_attention.linear_qkv."):
                kind = rest.rsplit(".", 1)[1]
                q, k, v = _split_qkv(t, s)
                for proj, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    out[f"{h}self_attn.{proj}.{kind}"] = part
            elif rest == "mlp.linear_fc1.weight":
                gate, up = torch.chunk(t, 2, dim=0)
                out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
            elif rest.startswith("mlp.") and s.moe is not None:
                moe_parts.setdefault(h, {})[rest.removeprefix("mlp.")] = t
            else:
                raise KeyError(f"megatron_to_hf: no HF name for {name!r}")
        else:
            raise KeyError(f"megatron_to_hf: no HF name for {name!r}")
    for h, parts in moe_parts.items():
        assert s.moe is not None
        out.update(moe_layer_to_hf(parts, h, s.moe.experts))
    if s.tied and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _kind(name: str) -> str:
    if name.endswith(ROW_PARALLEL):
        return "row"
    if name.endswith(COLUMN_PARALLEL):
        return "fc1" if name.endswith("linear_fc1.weight") else "column"
    return "replicated"


def shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's piece of a full megatron tensor."""
    kind = _kind(name)
    if size == 1 or kind == "replicated":
        return full
    if kind == "row":
        return torch.chunk(full, size, dim=1)[rank]
    if kind == "fc1":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, size)[rank], torch.chunk(up, size)[rank]])
    # qkv is interleaved per query group, so contiguous row blocks are whole groups
    return torch.chunk(full, size, dim=0)[rank]


def unshard(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard` over all TP ranks' pieces (in rank order)."""
    kind = _kind(name)
    if len(pieces) == 1 or kind == "replicated":
        return pieces[0]
    if kind == "row":
        return torch.cat(pieces, dim=1)
    if kind == "fc1":
        halves = [torch.chunk(p, 2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(pieces, dim=0)
