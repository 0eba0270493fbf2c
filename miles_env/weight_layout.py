"""A model's weights in memory and in its checkpoint files: the same tensors in two layouts.

Concept: transformers 5 holds a mixture-of-experts layer's experts fused, one 3-D tensor per
projection (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first; `mlp.experts.down_proj`
[E, H, I]), while the checkpoint files of the Qwen2-MoE / Qwen3-MoE layout (what `from_pretrained`,
SGLang and vLLM read) keep one 2-D tensor per expert (`mlp.experts.{e}.gate_proj.weight` [I, H],
`up_proj` [I, H], `down_proj` [H, I]). `to_checkpoint` and `to_model` convert between the two by
slicing and stacking, bit for bit: the conversion transformers' own `qwen2_moe` WeightConverter
applies on load and reverts on `save_pretrained` (tests/test_moe.py checks them against it). Dense
models have nothing to convert: both functions pass their tensors through.

Who uses which layout: in process (trainer state dicts, the hf engine, full and delta syncs) the
model's; on disk (`export_weights`, a full sync through disk, a remote engine's load) the
checkpoint's. Core module: torch is only touched through the tensors passed in.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["has_fused_experts", "to_checkpoint", "to_model"]

_FUSED = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)")
_PER_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def has_fused_experts(names: Collection[str]) -> bool:
    return any(_FUSED.fullmatch(n) for n in names)


def to_checkpoint(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model layout -> checkpoint layout: each fused expert tensor becomes E per-expert views."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _FUSED.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
    return out


def to_model(
    state: Mapping[str, torch.Tensor], fused: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """Checkpoint layout -> model layout: a layer's per-expert tensors are stacked into its fused
    ones. `fused`: the model's own tensor names; a layer whose model keeps its experts apart (its
    `gate_up_proj` is not among them) is left as it is. None: fuse every layer found. A layer must
    come whole (every expert, every projection): a fused tensor is replaced whole or not at all."""
    import torch

    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _PER_EXPERT.fullmatch(name)
        if m is None or (fused is not None and f"{m.group(1)}.gate_up_proj" not in fused):
            out[name] = t
            continue
        groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
    for prefix, kinds in groups.items():
        counts = {k: sorted(v) for k, v in kinds.items()}
        n = max(max(v) for v in counts.values()) + 1
        whole = list(range(n))
        if set(counts) != {"gate_proj", "up_proj", "down_proj"} or any(v != whole for v in counts.values()):
            have = {k: len(v) for k, v in counts.items()}
            raise ValueError(f"{prefix}: expert tensors are incomplete ({have} of {n} experts each)")
        gate, up, down = (
            torch.stack([kinds[k][e] for e in whole]) for k in ("gate_proj", "up_proj", "down_proj")
        )
        out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{prefix}.down_proj"] = down
    return out
