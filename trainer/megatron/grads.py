"""Gradient reductions of the megatron backend (the plain path; megatron's DDP does its own).

Concept: after the backward, the tied embedding / output-layer copies on the first and last pipeline
stage are summed over the embedding group, every dense gradient over the data-parallel ranks (with
context parallelism, data x context: each cp rank back-propagated its own part of each sequence),
and every expert shard's over the expert-data-parallel ranks (those holding the same experts;
megatron marks expert parameters `allreduce=False` under expert parallelism).

Invariants: afterwards every replica holds the same gradients, so the replicas and the two tied
copies stay bit-identical under the same AdamW step. The grad norm counts each parameter once (TP
shards summed, replicated tensors and the tied copy once, each expert once over the ep ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from miles_env.trainer.megatron.stage import StageTrainer

__all__ = ["grad_norm", "reduce_grads"]


def _ps() -> Any:
    from megatron.core import parallel_state

    return parallel_state


def _tied_copy(tr: StageTrainer) -> torch.nn.Parameter | None:
    """The embedding (first stage) or output-layer (last stage) weight of a tied model split over
    pipeline stages; None when the tied weight lives on one stage only."""
    ps = _ps()
    if not tr.shape.tied or ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    if ps.is_pipeline_first_stage():
        return tr.model.embedding.word_embeddings.weight  # type: ignore[no-any-return]
    if ps.is_pipeline_last_stage():
        return tr.model.output_layer.weight  # type: ignore[no-any-return]
    return None


def _all_reduce_flat(params: list[torch.nn.Parameter], group: Any) -> None:
    dist = torch.distributed
    if not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
    dist.all_reduce(flat, group=group)
    pos = 0
    for p in params:
        assert p.grad is not None
        p.grad.copy_(flat[pos : pos + p.numel()].view_as(p.grad))
        pos += p.numel()


def _is_expert(p: torch.nn.Parameter) -> bool:
    """An expert-parallel shard (megatron marks them allreduce=False): its replicas are the
    expert-data-parallel ranks, not the data-parallel ones."""
    return not getattr(p, "allreduce", True)


def reduce_grads(tr: StageTrainer) -> None:
    """Sum the tied copies' grads over the embedding group, every dense grad over data-parallel ranks
    and every expert shard's over expert-data-parallel ranks (the ranks holding the same experts)."""
    dist, ps = torch.distributed, _ps()
    params = [p for p in tr.model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # a data-parallel rank without microbatches still takes part
            p.grad = torch.zeros_like(p)
    tied = _tied_copy(tr)
    if tied is not None and tied.grad is not None:
        dist.all_reduce(tied.grad, group=ps.get_embedding_group())
    if ps.get_data_parallel_world_size() * tr.cp_size > 1:  # cp ranks are replicas too (context.py)
        group = ps.get_data_parallel_group(with_context_parallel=True)
        _all_reduce_flat([p for p in params if not _is_expert(p)], group)
    if tr.ep_size > 1 and ps.get_expert_data_parallel_world_size() > 1:
        _all_reduce_flat([p for p in params if _is_expert(p)], ps.get_expert_data_parallel_group())


def grad_norm(tr: StageTrainer) -> float:
    """Global L2 norm: TP shards summed, replicated tensors on TP rank 0 only, the tied copy on the
    last stage skipped, all summed over the model-parallel (tp x pp) group; expert shards summed over
    the expert x pipeline group (each expert counted once)."""
    ps = _ps()
    tied = _tied_copy(tr)
    skip = tied if tied is not None and not ps.is_pipeline_first_stage() else None
    sq = [0.0, 0.0]  # dense, experts
    for p in tr.model.parameters():
        if p.grad is None or p is skip:
            continue
        if _is_expert(p):
            sq[1] += float(p.grad.float().pow(2).sum())
        elif getattr(p, "tensor_model_parallel", False) or tr.tp_rank == 0:
            sq[0] += float(p.grad.float().pow(2).sum())
    dense = _summed(tr, sq[0], tr.tp_size * tr.pp_size, ps.get_model_parallel_group)
    experts = 0.0
    if tr.ep_size > 1:
        experts = _summed(
            tr, sq[1], tr.ep_size * tr.pp_size, ps.get_expert_tensor_model_pipeline_parallel_group
        )
    return float((dense + experts) ** 0.5)


def _summed(tr: StageTrainer, value: float, size: int, group: Callable[[], Any]) -> float:
    if size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=tr.device)  # nccl: CUDA tensors only
    torch.distributed.all_reduce(t, group=group())
    return float(t)
