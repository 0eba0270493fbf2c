"""Mixture-of-experts in the trainer: router taps, the load-balancing loss, routing records.

Concept: a MoE layer's router scores each token over E experts and sends it to its top k. During a
training forward `RouterTap` hooks every router of a model (transformers' `*TopKRouter` modules,
megatron-core's `TopKRouter`) and, per layer, takes the Switch-Transformer load-balancing loss over
the microbatch's real tokens (padding excluded): aux = E * sum_e f_e * P_e, f_e the share of the
top-k slots routed to expert e and P_e its mean router probability (1.0 when balanced; megatron's
`switch_load_balancing_loss_func` formula). Its gradient is attached where it arises (an identity
on the router's routing weights whose backward adds coef * aux's), so it reaches the router on
every pipeline stage and under FSDP2 without a term in the last stage's loss; the step's loss is
the policy loss plus coef x the token-weighted mean over microbatches of the layer-mean aux.

Invariants: both backends compute the same aux from the same router logits (the megatron backend
turns megatron's own aux loss off, `moe_router_load_balancing_type="none"`), and a microbatch's
weight is its real tokens over the step's, so summing over data-parallel or expert-parallel ranks
gives the single process's loss and gradient. `routed_experts` is the top-k experts of every
position, in the engine's order (the hf engine records the same per sampled token, so
`router_agreement` measures rollout-vs-training routing consistency). A sample that carries the
rollout's routing (`Trajectory.routed_experts`, through TITO) is compared in the training forward
itself: the trainer's top-k at the position that produced each mask-1 token against the engine's,
summed over the step as `moe_router_agreement` (the share of (token, layer) whose expert sets are
equal; absent when no sample carried routing).

Lifecycle: `MoeAux(shape, coef, layers)` per trainer; per step `begin(total_real_tokens)`, per microbatch
`with aux.tap(model, lengths, width, real, device, samples)`, at the end `metrics()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles_env.types import RoutedExperts

__all__ = ["MoeAux", "MoeShape", "RouterTap", "load_balancing_loss", "moe_shape", "router_agreement",
           "rollout_routing", "routed_experts", "routers"]  # fmt: skip


@dataclass(frozen=True, slots=True)
class MoeShape:
    experts: int
    top_k: int
    norm_topk: bool  # renormalise the top-k probabilities (Qwen3-MoE) or keep softmax's (Qwen2-MoE)
    ffn: int  # per expert
    shared_ffn: int  # the gated shared expert's (Qwen2-MoE); 0 = none
    aux_coef: float  # the model config's router_aux_loss_coef


def moe_shape(hf_config: Any) -> MoeShape | None:
    """The MoE shape of an HF config (Qwen2-MoE / Qwen3-MoE fields); None for a dense model."""
    experts = int(getattr(hf_config, "num_experts", 0) or 0)
    if experts <= 0:
        return None
    return MoeShape(
        experts=experts,
        top_k=int(hf_config.num_experts_per_tok),
        norm_topk=bool(getattr(hf_config, "norm_topk_prob", False)),
        ffn=int(hf_config.moe_intermediate_size),
        shared_ffn=int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0),
        aux_coef=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
    )


def routers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """(router, seq_first) for every MoE router of `model`, in layer order: transformers' routers
    see [B*L, H] (batch first), megatron-core's see [S, B, H]."""
    found = []
    for mod in model.modules():
        name = type(mod).__name__
        if name == "TopKRouter" and type(mod).__module__.startswith("megatron."):
            found.append((mod, True))
        elif name.endswith("TopKRouter"):
            found.append((mod, False))
    return found


def load_balancing_loss(logits: torch.Tensor, valid: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch load-balancing loss of one layer: `logits` [N, E] over `valid` [N] bool tokens."""
    p = torch.softmax(logits[valid].float(), dim=-1)
    n, e = p.shape
    if n == 0:
        return p.sum() * 0.0
    chosen = p.topk(top_k, dim=-1).indices
    share = torch.zeros(e, device=p.device).scatter_add_(
        0, chosen.reshape(-1), torch.ones(chosen.numel(), device=p.device)
    )
    return e * ((share / (n * top_k)) * p.mean(0)).sum()


class _AttachAux(torch.autograd.Function):
    """Identity on `x` whose backward also gives `aux` a gradient of 1 (so d aux / d params is added)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


class RouterTap:
    """Forward hooks on a model's routers for one forward: each layer's logits as [B, L, E], and
    with `weight` > 0 each layer's aux loss * weight attached to its routing weights."""

    def __init__(self, model: torch.nn.Module, valid: torch.Tensor, top_k: int, weight: float) -> None:
        self.valid, self.top_k, self.weight = valid, top_k, weight  # valid: [B, L] bool
        self.logits: list[torch.Tensor] = []
        self.aux: list[float] = []
        self._handles = [r.register_forward_hook(self._hook(seq_first)) for r, seq_first in routers(model)]
        self.layers = len(self._handles)

    def _hook(self, seq_first: bool) -> Any:
        def hook(mod: torch.nn.Module, args: tuple[Any, ...], out: Any) -> Any:
            b, n = self.valid.shape
            if seq_first:  # megatron: logits from the router's input [S, B, H] (it returns probs, map)
                weight: torch.Tensor = mod.weight  # type: ignore[assignment]
                logits = torch.nn.functional.linear(args[0].to(weight.dtype), weight).transpose(0, 1)
            else:
                logits = out[0].view(b, n, -1)
            self.logits.append(logits.detach())
            aux = load_balancing_loss(logits.reshape(b * n, -1), self.valid.reshape(-1), self.top_k)
            self.aux.append(float(aux.detach()))
            if self.weight <= 0 or not torch.is_grad_enabled():
                return None
            weights = _AttachAux.apply(out[1] if not seq_first else out[0], aux * self.weight)
            return (out[0], weights, *out[2:]) if not seq_first else (weights, *out[1:])

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def valid_positions(lengths: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
    """[B, width] bool: True at each row's real tokens (rows are right-padded)."""
    return torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


class MoeAux:
    """A trainer's MoE bookkeeping over a step: the tap per microbatch, the aux metric."""

    def __init__(self, shape: MoeShape, coef: float | None, layers: int) -> None:
        self.shape, self.layers = shape, max(layers, 1)  # every MoE layer of the model, on all stages
        self.coef = shape.aux_coef if coef is None else coef
        self.total = 1
        self.aux_sum = 0.0  # sum over microbatches and layers of aux_l / layers * real_mb / total
        self.load = torch.zeros(shape.experts, dtype=torch.float64)  # top-k slots per expert
        self.agree = self.compared = 0  # (token, layer) pairs the rollout's routing was compared on

    def begin(self, total_tokens: int) -> None:
        self.total, self.aux_sum = max(int(total_tokens), 1), 0.0
        self.load.zero_()
        self.agree = self.compared = 0

    @contextlib.contextmanager
    def tap(self, model: torch.nn.Module, lengths: Sequence[int], width: int, real: bool = True,
            device: torch.device | None = None, samples: Sequence[Any] = ()) -> Iterator[RouterTap]:  # fmt: skip
        """One microbatch's forward (and, after the block, its backward) with the aux attached;
        `real` False: a zero-weight filler (FSDP2, expert parallel), counted nowhere. `samples`: the
        microbatch's rows (with `loss_mask`, `routed_experts`), to compare the rollout's routing."""
        valid = valid_positions(lengths, width, device or torch.device("cpu"))
        share = sum(lengths) / self.total if real else 0.0
        tap = RouterTap(model, valid, self.shape.top_k, self.coef * share / self.layers)
        try:
            yield tap
        finally:
            tap.close()
        if real and tap.layers:
            self.aux_sum += sum(tap.aux) / self.layers * share
            for logits in tap.logits:
                chosen = logits[valid].topk(self.shape.top_k, dim=-1).indices.reshape(-1).cpu()
                self.load += torch.bincount(chosen, minlength=self.shape.experts).double()
            for row, sample in enumerate(samples):
                if sample.routed_experts is not None:
                    self._compare(tap.logits, row, sample.loss_mask, sample.routed_experts)

    def _compare(self, logits: list[torch.Tensor], row: int, mask: Sequence[int], rec: RoutedExperts) -> None:
        """Count the (token, layer) pairs where the rollout's routing equals this forward's."""
        k = self.shape.top_k
        if (rec.layers, rec.top_k) != (len(logits), k):
            raise ValueError(
                f"routed_experts: {rec.layers} layers x top {rec.top_k}; the model routes {len(logits)} x top {k}"
            )
        pos, theirs = rollout_routing(mask, rec)
        at = pos.to(logits[0].device)
        mine = torch.stack([lg[row, at].topk(k, dim=-1).indices for lg in logits], dim=1).cpu()
        same = (mine.sort(-1).values == theirs.sort(-1).values).all(-1)
        self.agree += int(same.sum())
        self.compared += same.numel()

    def metrics(self, reduce: Any = None) -> dict[str, float]:
        """`moe_aux_loss` (before the coefficient), `moe_max_load` (the busiest expert's share of
        routed slots x E: 1.0 is balanced), and `moe_router_agreement` when a sample carried the
        rollout's routing. `reduce(vector) -> vector` sums over ranks."""
        head = torch.tensor([self.aux_sum, self.agree, self.compared], dtype=torch.float64)
        vec = torch.cat([head, self.load])
        if reduce is not None:
            vec = reduce(vec)
        load = vec[3:]
        top = float(load.max() / load.sum() * self.shape.experts) if float(load.sum()) > 0 else float("nan")
        out = {"moe_aux_loss": float(vec[0]), "moe_aux_coef": self.coef, "moe_max_load": top}
        if float(vec[2]) > 0:
            out["moe_router_agreement"] = float(vec[1] / vec[2])
        return out


@torch.no_grad()
def routed_experts(model: torch.nn.Module, ids: torch.Tensor, top_k: int) -> torch.Tensor:
    """[L, layers, k] the top-k experts (sorted) each position of `ids` [L] is routed to, by an HF
    forward of `model` (the hf engine records the same for the positions it feeds)."""
    ids = ids.to(next(model.parameters()).device)
    tap = RouterTap(model, torch.ones(1, ids.numel(), dtype=torch.bool, device=ids.device), top_k, 0.0)
    try:
        model(input_ids=ids.view(1, -1), use_cache=False)
    finally:
        tap.close()
    per_layer = [lg[0].topk(top_k, dim=-1).indices.sort(-1).values for lg in tap.logits]
    return torch.stack(per_layer, dim=1).cpu()


def rollout_routing(mask: Sequence[int], rec: RoutedExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [n], experts [n, layers, k]) of a sample's rollout routing: the j-th mask-1 token's
    row belongs to the position before it (the one whose forward sampled it); a token at 0 has none."""
    experts = torch.tensor(rec.ids(), dtype=torch.long).view(rec.tokens, rec.layers, rec.top_k)
    pos = torch.tensor([i - 1 for i, m in enumerate(mask) if m], dtype=torch.long)
    keep = pos >= 0
    return pos[keep], experts[keep]


def router_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of (position, layer) whose top-k expert sets are equal in two [N, layers, k] records."""
    if a.shape != b.shape or a.numel() == 0:
        raise ValueError(f"router records differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    same = (a.sort(-1).values == b.sort(-1).values).all(-1)
    return float(same.float().mean())
