"""FSDP2 data parallelism for the torch backend: one model sharded over torchrun ranks (gloo or nccl).

Concept: every rank holds 1/world of each weight (`fully_shard` on every decoder layer, then the
root) and receives the same GRPO groups (trainer/ranks.py's Leader broadcasts them). A rank trains
the samples `samples[rank::world]`, packed into its own microbatches; every rank runs as many
microbatches as the busiest one, topping up with a zero-weight copy of a real microbatch, because
an FSDP2 forward/backward is collective. The loss normaliser is the step's (trainer/losses.py's
`totals`), so the sum of the ranks' gradients is the single-process gradient: the reduce-scatter
sums (`set_gradient_divide_factor(1.0)`) instead of FSDP2's default mean. The step's metrics are
summed (max for logprob_diff_max) over ranks, so every rank reports what one process would.

State crosses ranks only as full tensors: `full_state` gathers the model to rank 0's CPU (torch's
distributed `get_model_state_dict`, full_state_dict + cpu_offload), and the optimizer state goes
to disk in the single-process format (integer-keyed, as `optimizer.state_dict()`), converted from
and to the FQN-keyed full state of `get_/set_optimizer_state_dict`. A checkpoint written by N ranks
therefore resumes on M, and one written by one process resumes on N. Rank 0 reads and writes
files; the others receive what they need by broadcast.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "World",
    "deal",
    "full_optimizer_state",
    "full_state",
    "init_world",
    "load_full_model_state",
    "load_optimizer_state",
    "merged_lora_state",
    "reduce_metrics",
    "shard",
]


def init_world(device: torch.device) -> tuple[int, int]:
    """(rank, world) of the default process group; under torchrun (WORLD_SIZE > 1) it is created
    here when nobody has yet (nccl on CUDA, gloo on CPU). Outside torchrun: (0, 1), no group."""
    if not dist.is_available():
        return 0, 1
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


@dataclass(frozen=True, slots=True)
class World:
    """This rank's place: `rank`, `world`, and `sharded` (world > 1, the model is FSDP2-sharded)."""

    rank: int = 0
    world: int = 1

    @property
    def sharded(self) -> bool:
        return self.world > 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (itself when not sharded)."""
        if not self.sharded:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def shard(model: Any, device: torch.device, world: int, methods: dict[str, Callable[..., Any]]) -> None:
    """FSDP2 over a 1-D mesh of every rank: each decoder layer, then the root (embeddings, final norm,
    LM head: tied ones stay one tensor). Gradients are summed over ranks, not averaged. `methods`
    (name -> f(model, *args)) become methods of the model that gather the root's weights as its
    forward does (a call that runs the decoder and the head apart would find them sharded)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    for name, fn in methods.items():
        setattr(model, name, functools.partial(fn, model))
        register_fsdp_forward_method(model, name)


def deal(
    lengths: Sequence[int],
    budget: int,
    pack: Callable[[Sequence[int], int], list[list[int]]],
    rank: int,
    world: int,
) -> list[list[int] | None]:
    """This rank's microbatches (global sample indices) of `samples[rank::world]`, packed under
    `budget`, then None (a zero-weight filler) up to the busiest rank's count."""
    per_rank = []
    for r in range(world):
        mine = list(range(r, len(lengths), world))
        per_rank.append([[mine[i] for i in mb] for mb in pack([lengths[i] for i in mine], budget)])
    most = max(len(p) for p in per_rank)
    own: list[list[int] | None] = list(per_rank[rank])
    return own + [None] * (most - len(own))


def reduce_metrics(
    sums: list[float], maxima: list[float], device: torch.device
) -> tuple[list[float], list[float]]:
    """Every rank's `sums` summed and `maxima` maxed, in float64."""
    s = torch.tensor(sums, dtype=torch.float64, device=device)
    m = torch.tensor(maxima, dtype=torch.float64, device=device)
    dist.all_reduce(s, op=dist.ReduceOp.SUM)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return s.tolist(), m.tolist()


def full_state(model: Any) -> dict[str, torch.Tensor]:
    """The model's full state dict (its own names) on rank 0's CPU, tied entries (lm_head =
    embed_tokens) one tensor again as in the model; {} on the other ranks. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out: dict[str, torch.Tensor] = get_model_state_dict(model, options=opts)  # type: ignore[assignment]
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in out:
            out[name] = out[first.setdefault(id(p), name)]
    return out


def load_full_model_state(model: Any, state: dict[str, Any], strict: bool = True) -> None:
    """Rank 0's full `state` (own names) into every rank's shards; the others pass {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(model, state, options=opts)


def merged_lora_state(model: Any, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named full weights with each LoRA module's delta (scale * B @ A; per expert for a MoE's
    fused experts, PEFT's ParamWrapper) merged in, from the gathered `full` state (trainer/lora.py's
    merged_state, for a sharded model)."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import ParamWrapper

    from miles_env.trainer.lora import ADAPTER_NAME, hf_name

    if not full:  # a rank other than 0: the gather gave it nothing
        return {}
    deltas: dict[str, torch.Tensor] = {}
    for name, mod in model.named_modules():
        if not (isinstance(mod, LoraLinear | ParamWrapper) and ADAPTER_NAME in mod.lora_A):
            continue
        a = full[f"{name}.lora_A.{ADAPTER_NAME}.weight"].float()
        b = full[f"{name}.lora_B.{ADAPTER_NAME}.weight"].float()
        scale = float(mod.scaling[ADAPTER_NAME])
        if isinstance(mod, ParamWrapper) and mod.num_experts > 1:
            deltas[hf_name(f"{name}.{mod.parameter_name}")] = _expert_delta(mod, a, b) * scale
        else:
            param = mod.parameter_name if isinstance(mod, ParamWrapper) else "weight"
            deltas[hf_name(f"{name}.{param}")] = (b @ a) * scale
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        if ".lora_" in name:
            continue
        hf = hf_name(name)
        out[hf] = t + deltas[hf].to(t.dtype) if hf in deltas else t
    return out


def _expert_delta(mod: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """PEFT ParamWrapper's per-expert delta (its get_delta_weight) from full lora_A [r*E, in] and
    lora_B [out, r*E]: [E, out, in] when PEFT swapped the 3-D parameter's features, else [E, in, out]."""
    e = mod.num_experts
    a3, b3 = a.reshape(e, -1, a.shape[-1]), b.reshape(b.shape[0], -1, e)
    return torch.einsum(
        "o r e, e r i -> e o i" if mod._did_swap_in_out_features else "o r e, e r i -> e i o", b3, a3
    )


def _fqns(optimizer: torch.optim.Optimizer, model: Any) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's full state in `optimizer.state_dict()`'s single-process format (params as
    indices in param-group order), on rank 0's CPU; {} on the others. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    osd: dict[str, Any] = get_optimizer_state_dict(model, optimizer, options=opts)  # type: ignore[assignment]
    if not osd:
        return {}
    index = {n: i for i, n in enumerate(_fqns(optimizer, model))}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]
    return {"state": {index[n]: s for n, s in osd["state"].items()}, "param_groups": groups}


def load_optimizer_state(model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Rank 0's single-process optimizer `state` into every rank's shards; the others pass {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if state:
        names = _fqns(optimizer, model)
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
        state = {"state": {names[i]: s for i, s in state["state"].items()}, "param_groups": groups}
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model, optimizer, state, options=opts)
