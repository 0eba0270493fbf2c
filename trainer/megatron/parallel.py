"""Pipeline and data parallelism of the megatron backend: stage models, megatron's pipeline
schedule, gradient reductions and the gather of every stage's weights back into full HF tensors.

Concept: the world is tp * pp * dp ranks (megatron's parallel_state lays them out). Each pipeline
stage builds a GPTModel with pre_process (embedding) on the first stage, post_process (final norm
and LM head) on the last, and the layers megatron's own `get_num_layers_to_build` /
`get_transformer_layer_offset` give it. A step splits the step's microbatches round-robin over
data-parallel ranks and runs them through megatron-core's `get_forward_backward_func` schedule
(1F1B for pp > 1); the last stage applies the same GRPO losses as the torch backend, with the
step's global token/sequence denominators, so summing gradients over data-parallel ranks gives the
gradient of the whole batch.

Invariants: the gradient reductions (`megatron.grads`) keep the replicas bit-identical. Metrics are
reduced over data-parallel ranks and broadcast from the last stage, so every rank returns the same
dict. Expert parallelism (`megatron.experts`, `megatron.batches`): each rank builds only its experts,
runs as many microbatches as the busiest ep rank, and `gather_hf_state` collects every expert.

Lifecycle: `build_stage_model` at construction; `pipeline_train_step` per step (only when pp, dp or
cp > 1: otherwise TorchTrainer's step); `gather_hf_state` for weight sync and export.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from miles_env.trainer.losses import microbatch_loss
from miles_env.trainer.megatron.batches import one_shape, step_batches
from miles_env.trainer.megatron.context import cp_full, te_layer_spec, te_names
from miles_env.trainer.megatron.convert import hf_to_megatron, megatron_to_hf, shard, unshard
from miles_env.trainer.megatron.experts import ep_global, ep_slice, is_expert_name
from miles_env.trainer.megatron.stage import StageTrainer
from miles_env.trainer.torch_backend import Sample, _Metrics, flatten_groups, pack_microbatches
from miles_env.types import Episode

__all__ = [
    "build_stage_model",
    "pipeline_train_step",
    "pipeline_logprobs",
    "gather_hf_state",
    "distributed_optimizer",
]


def _ps() -> Any:
    from megatron.core import parallel_state

    return parallel_state


def build_stage_model(tr: StageTrainer, tcfg: Any, full_hf: dict[str, torch.Tensor]) -> torch.nn.Module:
    """This rank's GPTModel (its pipeline stage, its TP shard) holding the converted HF weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    ps, s = _ps(), tr.shape
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    experts = s.moe.experts if s.moe is not None else None
    spec = (
        te_layer_spec(s)  # context parallelism runs only in TransformerEngine's attention
        if tr.cp_size > 1
        else get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=s.qk_norm)
    )
    model = GPTModel(
        tcfg,
        spec,
        vocab_size=s.vocab,
        max_sequence_length=s.max_positions,
        pre_process=first,
        post_process=last,
        position_embedding_type="rope",
        rotary_base=int(s.rope_theta) if float(s.rope_theta).is_integer() else s.rope_theta,  # type: ignore[arg-type]
        share_embeddings_and_output_weights=s.tied,
        parallel_output=False,  # gather logits over the vocab: losses.token_logprobs as is
    )
    offset, n = get_transformer_layer_offset(tcfg), get_num_layers_to_build(tcfg)
    full = hf_to_megatron(full_hf, s, layer_offset=offset, num_layers=n)
    if not first:
        full.pop("embedding.word_embeddings.weight")
    if not last:
        full.pop("decoder.final_layernorm.weight")
        full.pop("output_layer.weight", None)
    elif s.tied and not first:  # the last stage's own copy of the tied embedding
        full["output_layer.weight"] = full_hf["model.embed_tokens.weight"]
    dtype = tcfg.params_dtype
    if experts is not None:  # this expert-parallel rank's experts, numbered from 0
        full = ep_slice(full, tr.ep_rank, tr.ep_size, experts)
    local = {k: shard(k, v, tr.tp_rank, tr.tp_size).to(dtype) for k, v in full.items()}
    if tr.cp_size > 1:
        local = te_names(local, experts is not None, to_te=True)
    missing, unexpected = model.load_state_dict(local, strict=False)
    real_missing = [k for k in missing if not k.endswith("_extra_state")]
    if real_missing or unexpected:
        raise ValueError(f"HF -> megatron: missing {real_missing[:4]}, unexpected {unexpected[:4]}")
    tr.layer_offset = offset
    return model.to(tr.device)


def distributed_optimizer(tr: StageTrainer) -> tuple[Any, Any]:
    """megatron's DDP wrapper (grads in one contiguous buffer, reduce-scattered over data-parallel
    ranks) and DistributedOptimizer (each dp rank holds and steps 1/dp of the optimizer state, then
    the updated params are all-gathered). The optimizer is torch's AdamW (no Apex / TE), weight decay
    on every parameter as in the torch backend."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from miles_env.trainer.megatron.cpu_shims import apply_optimizer_shims

    apply_optimizer_shims()
    cfg, model = tr.config, tr.model
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False)
    ddp = DistributedDataParallel(model.config, ddp_cfg, model)  # type: ignore[arg-type]
    ocfg = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.betas[0],
        adam_beta2=cfg.betas[1], adam_eps=cfg.adam_eps, clip_grad=cfg.grad_clip or 0.0,
        use_distributed_optimizer=True, bf16=cfg.dtype == "bfloat16", params_dtype=getattr(torch, cfg.dtype),
    )  # fmt: skip
    return ddp, get_megatron_optimizer(ocfg, [ddp], config_overrides={})


# -- the step ------------------------------------------------------------------------------------


def _run_schedule(
    tr: StageTrainer,
    model: torch.nn.Module,
    batches: Sequence[Any],
    loss_fn: Callable[[int, Any, torch.Tensor], torch.Tensor],
    forward_only: bool,
    masked: bool = True,
    wrapper: Any = None,
    real: Sequence[bool] | None = None,
) -> None:
    """Every batch through megatron's schedule; on the last stage `loss_fn(i, batch, logp)` gives the
    loss to backpropagate (not divided by the number of microbatches: calculate_per_token_loss).
    Training forwards run under the MoE router tap (trainer/moe.py); `real[i]` False: a filler."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not batches:
        return
    last = _ps().is_pipeline_last_stage()
    data = iter(enumerate(batches))

    def forward_step(data_iterator: Any, _wrapped: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        i, b = next(data_iterator)  # the bare model runs: DDP's grad hooks sit on its parameters
        tap = tr._moe_tap(b, real[i] if real else True) if not forward_only else contextlib.nullcontext()
        with tap:
            if not last:
                return tr.logits(b.ids, model), None  # hidden states [s, b, h], sent to the next stage
            logp = tr._forward_logprobs(model, b.ids, b.mask if masked else None)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            return loss_fn(i, b, output), torch.tensor(0, dtype=torch.int), {}

        return logp, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=[wrapper or model],  # the DDP wrapper when there is one: its no-sync and config
        num_microbatches=len(batches),
        seq_length=max(b.ids.shape[1] for b in batches),
        micro_batch_size=max(b.ids.shape[0] for b in batches),
        forward_only=forward_only,
    )


def pipeline_train_step(tr: StageTrainer, groups: Sequence[Sequence[Episode]]) -> dict[str, float]:
    """TorchTrainer.train_step over pipeline stages and data-parallel ranks (same losses, metrics)."""
    t0 = time.perf_counter()
    cfg = tr.config
    samples = flatten_groups(groups, cfg)
    totals = {
        "total_tokens": sum(sum(s.loss_mask[1:]) for s in samples),
        "total_seqs": len(samples),
        "norm_tokens": cfg.loss_norm_tokens,
    }
    mbs = pack_microbatches([len(s.token_ids) for s in samples], cfg.max_tokens_per_microbatch)
    batches, real = step_batches(tr, samples, mbs)
    if tr.moe is not None:
        tr.moe.begin(sum(len(s.token_ids) for s in samples))
    tr.model.train()
    if tr.ddp is not None:
        tr.ddp.zero_grad_buffer()
        tr.optimizer.zero_grad()
    else:
        tr.optimizer.zero_grad(set_to_none=True)
    refs: dict[int, torch.Tensor] = {}
    if tr.ref_model is not None:
        ref_model = tr.ref_model

        def keep_ref(i: int, _b: Any, logp: torch.Tensor) -> torch.Tensor:
            refs[i] = logp.detach()
            return logp.sum() * 0.0

        with torch.no_grad():
            _run_schedule(tr, ref_model, batches, keep_ref, forward_only=True)
    acc = _Metrics()

    def loss_fn(i: int, b: Any, logp: torch.Tensor) -> torch.Tensor:
        m = microbatch_loss(logp, b.rollout, b.adv, b.mask, refs.get(i), cfg, totals)
        loss = m.loss
        if real[i]:
            if tr.cp_size > 1:  # the metrics of every column, not only this cp rank's (context.py)
                ref = refs.get(i)
                full_ref = cp_full(tr, ref) if ref is not None else None
                m = microbatch_loss(cp_full(tr, logp), b.rollout, b.adv, b.mask, full_ref, cfg, totals)
            acc.add(m.pg, m.kl, m.clipped, m.weights, m.old - b.rollout, b.mask)
        return loss

    _run_schedule(tr, tr.model, batches, loss_fn, forward_only=False, wrapper=tr.ddp, real=real)
    norm = tr._clip_and_step()
    tr.step += 1
    n_tokens = sum(sum(b.lengths) for b in batches)
    pg, kl, clip, tis, dsum, dmax, ntok, mtok = _reduce_metrics(acc, n_tokens, tr.device)
    dt = time.perf_counter() - t0
    denom = max(mtok, 1.0)
    return {
        "step": float(tr.step),
        "loss": pg + cfg.kl_coef * kl,
        "pg_loss": pg,
        "kl": kl,
        "clip_frac": clip / denom,
        "tis_mean": tis / denom,
        "grad_norm": norm,
        "reward_mean": sum(ep.score for g in groups for ep in g) / max(sum(len(g) for g in groups), 1),
        "samples": float(len(samples)),
        "tokens": ntok,
        "loss_tokens": mtok,
        "tokens_per_s": ntok / dt if dt > 0 else 0.0,
        "step_time_s": dt,
        "logprob_diff_mean": dsum / denom if mtok else float("nan"),
        "logprob_diff_max": dmax if mtok else float("nan"),
        "skipped_samples": float(sum(len(ep.samples) for g in groups for ep in g) - len(samples)),
    }


@torch.no_grad()
def pipeline_logprobs(tr: StageTrainer, samples: Sequence[Sample]) -> list[torch.Tensor]:
    """TorchTrainer.logprobs through the pipeline: a forward-only schedule, the last stage's
    [L] logprobs per sample broadcast to every stage (each data-parallel replica runs them all)."""
    ps = _ps()
    tr.model.eval()
    mbs = pack_microbatches([len(s.token_ids) for s in samples], tr.config.max_tokens_per_microbatch)
    batches = one_shape(tr, [tr._collate([samples[i] for i in idx]) for idx in mbs])
    got: dict[int, torch.Tensor] = {}

    def keep(i: int, _b: Any, logp: torch.Tensor) -> torch.Tensor:
        got[i] = logp.float().contiguous()
        return logp.sum() * 0.0

    _run_schedule(tr, tr.model, batches, keep, forward_only=True, masked=False)
    out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
    for i, (idx, b) in enumerate(zip(mbs, batches, strict=True)):
        t = got.get(i, torch.empty(b.ids.shape, dtype=torch.float32, device=tr.device))
        torch.distributed.broadcast(
            t, ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
        for row, j in enumerate(idx):
            out[j] = t[row, : b.lengths[row]].cpu()
    return out


def _reduce_metrics(acc: _Metrics, n_tokens: int, device: torch.device) -> list[float]:
    """Sums over data-parallel ranks (max for diff_max), then the last stage's values everywhere.
    On `device`: nccl reduces only CUDA tensors."""
    dist, ps = torch.distributed, _ps()
    vec = torch.tensor([acc.pg, acc.kl, acc.clip, acc.tis, acc.diff_sum, acc.diff_max, n_tokens,
                        acc.mask_tokens], dtype=torch.float64, device=device)  # fmt: skip
    if ps.get_data_parallel_world_size() > 1:
        group = ps.get_data_parallel_group()
        top = vec[5:6].clone()
        dist.all_reduce(vec, group=group)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        vec[5] = top[0]
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            vec, ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
    return [float(v) for v in vec]


# -- weights ---------------------------------------------------------------------------------------


def _tp_gathered(tr: StageTrainer) -> dict[str, torch.Tensor]:
    local = {
        k: v.detach()
        for k, v in tr.model.state_dict().items()
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
    }
    if tr.cp_size > 1:
        local = te_names(local, tr.shape.moe is not None, to_te=False)
    if tr.tp_size == 1:
        return local
    group = _ps().get_tensor_model_parallel_group()
    full = {}
    for name, t in local.items():
        pieces = [torch.empty_like(t) for _ in range(tr.tp_size)]
        torch.distributed.all_gather(pieces, t.contiguous(), group=group)
        full[name] = unshard(name, pieces)
    return full


def _ep_gathered(tr: StageTrainer, mc: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`mc` with every expert of every ep rank under its global index (a collective over ep)."""
    if tr.ep_size == 1:
        return mc
    group = _ps().get_expert_model_parallel_group()
    names = sorted(k for k in mc if is_expert_name(k))
    per = len(names)
    out = {k: v for k, v in mc.items() if not is_expert_name(k)}
    local_experts = tr.shape.moe.experts // tr.ep_size if tr.shape.moe is not None else 0
    for name in names:
        pieces = [torch.empty_like(mc[name]) for _ in range(tr.ep_size)]
        torch.distributed.all_gather(pieces, mc[name].contiguous(), group=group)
        for rank, t in enumerate(pieces):
            out.update(ep_global({name: t}, rank, local_experts))
    assert len(out) == len(mc) - per + per * tr.ep_size
    return out


def gather_hf_state(tr: StageTrainer) -> dict[str, torch.Tensor]:
    """Full HF-named tensors of every layer, identical on every rank of this pipeline."""
    ps, s = _ps(), tr.shape
    mc = _ep_gathered(tr, _tp_gathered(tr))
    pp = ps.get_pipeline_model_parallel_world_size()
    if s.tied and pp > 1 and not ps.is_pipeline_first_stage():
        mc.pop("output_layer.weight", None)  # the first stage's embedding is the one exported
    hf = megatron_to_hf(mc, s, layer_offset=tr.layer_offset)
    if pp == 1:
        return hf
    dist, group = torch.distributed, ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    metas: list[Any] = [None] * pp
    dist.all_gather_object(metas, [(k, tuple(v.shape), v.dtype) for k, v in hf.items() if k != "lm_head.weight" or not s.tied], group=group)  # fmt: skip
    out: dict[str, torch.Tensor] = {}
    for stage, meta in enumerate(metas):
        for name, shape, dtype in meta:
            t = hf[name].contiguous() if stage == ps.get_pipeline_model_parallel_rank() else torch.empty(shape, dtype=dtype, device=tr.device)  # fmt: skip
            dist.broadcast(t, ranks[stage], group=group)
            out[name] = t
    if s.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
