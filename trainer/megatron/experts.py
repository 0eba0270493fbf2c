"""Mixture-of-experts layers between HF and megatron-core, and their expert-parallel shards.

Concept: an HF MoE layer (the model layout of `miles_env.weight_layout`: `mlp.gate.weight` [E, H],
`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I], and for Qwen2-MoE a gated
shared expert `mlp.shared_expert.{gate,up,down}_proj` + `mlp.shared_expert_gate` [1, H]) maps onto
megatron-core's MoELayer with SequentialMLP experts: `mlp.router.weight`, one
`mlp.experts.local_experts.{e}.linear_fc{1,2}.weight` per expert ([gate; up] rows, as a dense
fc1), `mlp.shared_experts.linear_fc{1,2}.weight` and `mlp.shared_experts.gate_weight`. All of it is
slicing and concatenation, so HF -> megatron -> HF is bit-exact.

Expert parallel: rank r of an ep group of size n holds the experts [r * E/n, (r + 1) * E/n), under
local indices 0 .. E/n - 1 (megatron's SequentialMLP numbering); `ep_slice` cuts a full megatron
state to a rank's experts and `ep_global` renames a rank's local experts back to global indices
(the gather in parallel.py collects every rank's).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["ep_global", "ep_slice", "is_expert_name", "moe_layer_to_hf", "moe_layer_to_megatron"]

_LOCAL = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)")


def is_expert_name(name: str) -> bool:
    return _LOCAL.fullmatch(name) is not None


def moe_layer_to_megatron(
    hf: Mapping[str, torch.Tensor], h: str, mc: str, experts: int
) -> dict[str, torch.Tensor]:
    """Full megatron tensors of the MoE MLP of one layer: HF prefix `h` (`model.layers.N.`),
    megatron prefix `mc` (`decoder.layers.M.`)."""
    out = {mc + "mlp.router.weight": hf[h + "mlp.gate.weight"]}
    gate_up, down = hf[h + "mlp.experts.gate_up_proj"], hf[h + "mlp.experts.down_proj"]
    if gate_up.shape[0] != experts:
        raise ValueError(
            f"{h}mlp.experts.gate_up_proj holds {gate_up.shape[0]} experts, the config {experts}"
        )
    for e in range(experts):
        out[f"{mc}mlp.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
        out[f"{mc}mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
    s = h + "mlp.shared_expert."
    if s + "gate_proj.weight" in hf:
        out[mc + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"]]
        )
        out[mc + "mlp.shared_experts.linear_fc2.weight"] = hf[s + "down_proj.weight"]
        out[mc + "mlp.shared_experts.gate_weight"] = hf[h + "mlp.shared_expert_gate.weight"]
    return out


def moe_layer_to_hf(parts: Mapping[str, torch.Tensor], h: str, experts: int) -> dict[str, torch.Tensor]:
    """HF tensors of one layer's MoE MLP from its megatron tensors named relative to `mlp.`
    (`router.weight`, `experts.local_experts.{e}.linear_fc1.weight`, ...): all `experts` must be
    there (a fused HF tensor holds them all)."""
    out: dict[str, torch.Tensor] = {}
    fc: dict[str, dict[int, torch.Tensor]] = {"linear_fc1": {}, "linear_fc2": {}}
    for rest, t in parts.items():
        if rest == "router.weight":
            out[h + "mlp.gate.weight"] = t
        elif m := re.fullmatch(r"experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight", rest):
            fc[m.group(2)][int(m.group(1))] = t
        elif rest == "shared_experts.linear_fc1.weight":
            gate, up = torch.chunk(t, 2, dim=0)
            out[h + "mlp.shared_expert.gate_proj.weight"], out[h + "mlp.shared_expert.up_proj.weight"] = (
                gate,
                up,
            )
        elif rest == "shared_experts.linear_fc2.weight":
            out[h + "mlp.shared_expert.down_proj.weight"] = t
        elif rest == "shared_experts.gate_weight":
            out[h + "mlp.shared_expert_gate.weight"] = t
        else:
            raise KeyError(f"megatron_to_hf: no HF name for {h}mlp.{rest!r}")
    if fc["linear_fc1"] or fc["linear_fc2"]:
        whole = list(range(experts))
        if sorted(fc["linear_fc1"]) != whole or sorted(fc["linear_fc2"]) != whole:
            raise KeyError(f"megatron_to_hf: {h} experts incomplete: {sorted(fc['linear_fc1'])} of {experts}")
        out[h + "mlp.experts.gate_up_proj"] = torch.stack([fc["linear_fc1"][e] for e in whole])
        out[h + "mlp.experts.down_proj"] = torch.stack([fc["linear_fc2"][e] for e in whole])
    return out


def ep_slice(full: Mapping[str, torch.Tensor], rank: int, size: int, experts: int) -> dict[str, torch.Tensor]:
    """A rank's part of a full megatron state: every non-expert tensor, and its experts renumbered
    from 0 (megatron's local numbering)."""
    if size == 1:
        return dict(full)
    per = experts // size
    out: dict[str, Any] = {}
    for name, t in full.items():
        m = _LOCAL.fullmatch(name)
        if m is None:
            out[name] = t
        elif rank * per <= (e := int(m.group(2))) < (rank + 1) * per:
            out[f"{m.group(1)}{e - rank * per}{m.group(3)}"] = t
    return out


def ep_global(local: Mapping[str, torch.Tensor], rank: int, per_rank: int) -> dict[str, torch.Tensor]:
    """A rank's expert tensors renamed to their global indices (non-expert tensors are skipped)."""
    out = {}
    for name, t in local.items():
        if m := _LOCAL.fullmatch(name):
            out[f"{m.group(1)}{int(m.group(2)) + rank * per_rank}{m.group(3)}"] = t
    return out
