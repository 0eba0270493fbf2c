"""The megatron trainer backend: the torch backend's step on a megatron-core GPTModel.

Concept: `MegatronTrainer` builds a megatron-core GPTModel (local layer spec, no
TransformerEngine; the TE spec only for context parallelism) from an HF Llama / Qwen / Qwen2-MoE /
Qwen3-MoE config, loads the HF weights through
`megatron.convert`, and reuses TorchTrainer's step verbatim (flatten groups, pack
microbatches, the same pure losses from `losses.py`, one AdamW step). Only the
forward, the gradient clipping (norm reduced over tensor-parallel ranks) and the
weight export differ, so the two backends are interchangeable.

Invariants: `state_dict()` / `export_weights()` give full HF-named tensors (gathered over
tensor-parallel ranks), so the engine never sees megatron names; HF -> megatron -> HF is
bit-exact; logits are gathered over the vocabulary (parallel_output=False) so logprobs
use the same code as the torch backend.

Parallelism: world = tp * pp * cp * dp (megatron's parallel_state layout; `megatron.layout` refuses
what cannot run, at load). tp = tensor parallel; pp =
pipeline stages run by megatron-core's 1F1B schedule; dp = data parallel, microbatches split over
dp ranks, grads summed (see `megatron.parallel`): by a plain all-reduce and a full torch AdamW per
replica, or with `distributed_optimizer: true` by megatron's DDP + DistributedOptimizer (grads
reduce-scattered, Adam state sharded over dp, gathered to dp rank 0 in checkpoints). On CPU a gloo process group and
the shims of `megatron.cpu_shims`; TP=2, PP=2, DP=2 and PP=2 x DP=2 (both optimizers) are tested
against 1 under torchrun on CPU. On GPUs, nccl: TP=1 checked once on an H200, the rest untested.
ep = expert parallel (MoE): the experts of every layer sharded over ep of the data x context
parallel ranks, tokens moved by megatron's all-gather dispatcher on CPU (all-to-all on GPUs);
tested on CPU against one process (tests/test_megatron_ep.py). cp = context parallel: GPUs with
TransformerEngine only (`megatron.context`), refused on CPU. The MoE load-balancing loss is
trainer/moe.py's, the torch backend's (megatron's own is off).
With pp = dp = cp = 1 and no distributed optimizer the step is TorchTrainer's own.

Lifecycle: as TorchTrainer: build -> (load_checkpoint) -> train_step* -> state_dict /
export_weights for weight sync -> save_checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field, model_validator

from miles_env.models import resolve_model
from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.export import write_hf_dir
from miles_env.trainer.losses import token_logprobs
from miles_env.trainer.lr_schedule import apply_lr
from miles_env.trainer.megatron.batches import all_gather_dispatch
from miles_env.trainer.megatron.checkpoint import load_rank_checkpoint, save_rank_checkpoint
from miles_env.trainer.megatron.context import cp_full, cp_logprobs
from miles_env.trainer.megatron.convert import model_shape, transformer_config
from miles_env.trainer.megatron.cpu_shims import apply_cpu_shims, init_distributed
from miles_env.trainer.megatron.grads import grad_norm, reduce_grads
from miles_env.trainer.megatron.layout import check_layout, world_size
from miles_env.trainer.megatron.parallel import (
    build_stage_model,
    distributed_optimizer,
    gather_hf_state,
    pipeline_logprobs,
    pipeline_train_step,
)
from miles_env.trainer.moe import MoeAux
from miles_env.trainer.samples import flatten_groups
from miles_env.trainer.torch_backend import Sample, TorchTrainer
from miles_env.types import Episode, Trajectory
from miles_env.weight_layout import to_checkpoint, to_model

__all__ = ["MegatronTrainer", "MegatronTrainerConfig"]


class MegatronTrainerConfig(TrainerConfig):
    """TrainerConfig plus megatron's parallel layout."""

    tp: int = Field(1, ge=1, description="tensor-parallel size")
    pp: int = Field(1, ge=1, description="pipeline-parallel size; data parallel = world / (tp * pp * cp)")
    cp: int = Field(1, ge=1, description="context-parallel size (GPUs with TransformerEngine only)")
    ep: int = Field(
        1,
        ge=1,
        description="expert-parallel size: a MoE model's experts sharded over ep "
        "of the data x context parallel ranks",
    )
    distributed_optimizer: bool = Field(
        False,
        description="megatron DDP + DistributedOptimizer (grads reduce-scattered, AdamW state sharded "
        "over dp); false: grads all-reduced, a full torch AdamW per replica",
    )

    @model_validator(mode="after")
    def _no_lora(self) -> MegatronTrainerConfig:
        # megatron-core 0.16 has no adapter (LoRA) layers of its own; LoRA runs on the torch backend
        if self.lora is not None:
            raise ValueError("lora is not supported by the megatron backend (use trainer.backend=torch)")
        return self


class MegatronTrainer(TorchTrainer):
    config: MegatronTrainerConfig
    config_type: ClassVar[type[TrainerConfig]] = MegatronTrainerConfig

    def __init__(self, model_path: str | os.PathLike[str], config: TrainerConfig | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig

        cfg = config if isinstance(config, MegatronTrainerConfig) else MegatronTrainerConfig(
            **(config.model_dump() if config is not None else {})
        )  # fmt: skip
        self.config = cfg
        torch.manual_seed(cfg.seed)
        self.model_path = resolve_model(model_path)
        self.hf_config = AutoConfig.from_pretrained(str(self.model_path))
        self.shape = model_shape(self.hf_config)
        self.device = self._pick_device()
        check_layout(cfg, world_size(), self.shape)  # one line per impossible layout, before any group
        apply_cpu_shims()
        init_distributed(cfg.tp, cfg.pp, cfg.cp, cfg.ep)
        if torch.cuda.is_available():  # megatron's model-parallel CUDA RNG streams (the CPU shim skips them)
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(cfg.seed)
        from megatron.core import parallel_state as ps

        self.tp_rank, self.tp_size = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
        )
        self.pp_rank, self.pp_size = ps.get_pipeline_model_parallel_rank(), cfg.pp
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.ep_rank, self.ep_size = ps.get_expert_model_parallel_rank(), cfg.ep
        self.cp_rank, self.cp_size = ps.get_context_parallel_rank(), cfg.cp
        moe = self.shape.moe
        self.moe = MoeAux(moe, cfg.moe_aux_loss_coef, self.shape.layers) if moe is not None else None
        self.layer_offset = 0
        self.step = 0
        self.model = self._build_model()
        self.ref_model = self._frozen_copy() if cfg.kl_coef > 0 else None
        self.sharded = False
        self.ddp: Any = None
        self._nothing_to_train = False  # this step has no sample (dynamic sampling's skip, all-equal groups)
        self.optimizer: Any
        if cfg.distributed_optimizer:
            self.ddp, self.optimizer = distributed_optimizer(self)
            return
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.lr,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
            eps=cfg.adam_eps,
            fused=cfg.fused_adamw,
        )

    def _build_model(self) -> torch.nn.Module:
        dtype = getattr(torch, self.config.dtype)
        tcfg = transformer_config(
            self.shape,
            dtype,
            tensor_model_parallel_size=self.tp_size,
            pipeline_model_parallel_size=self.pp_size,
            context_parallel_size=self.cp_size,
            expert_model_parallel_size=self.ep_size,
            pipeline_dtype=dtype,
            # microbatches differ in shape: stages exchange shapes first; the all-gather token
            # dispatcher (MoE on CPU) refuses that, and its microbatches are padded to one shape
            variable_seq_lengths=not all_gather_dispatch(self.shape),
            batch_p2p_comm=False,  # plain isend/irecv (batched p2p syncs CUDA)
            calculate_per_token_loss=True,  # the losses carry global denominators: no 1/num_microbatches
            **(
                {} if self.shape.moe else {"moe_token_dispatcher_type": "alltoall"}
            ),  # the default refuses variable lengths
        )
        hf = to_model(_read_hf_weights(self.model_path))  # the checkpoint files' layout -> the model's
        return build_stage_model(self, tcfg, hf)

    def _frozen_copy(self) -> torch.nn.Module:
        """The reference model: a second build from the HF weights (a deepcopy would have to copy the
        process groups that pipeline-stage modules hold)."""
        ref = self._build_model().eval()
        ref.requires_grad_(False)
        return ref

    # -- forward -------------------------------------------------------------------------------

    def _forward_logprobs(
        self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[B, L] logprobs of each next token (column 0 is 0). With `mask`, as the torch backend, the
        LM head runs only where mask == 1 (a pre-hook on megatron's output layer keeps just those
        hidden states); positions outside the mask are 0."""
        if self.cp_size > 1:  # this rank's part of each sequence (context.py); the whole for eval
            partial = cp_logprobs(self, model, ids)
            return partial if mask is not None else cp_full(self, partial)
        if mask is None:
            return token_logprobs(self.logits(ids, model), ids, self.config.temperature)
        sel = mask[:, 1:] > 0  # the logprob of token t comes from position t - 1

        def keep_loss_positions(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            hidden = args[0].transpose(0, 1)[:, :-1][sel]  # megatron is [s, b, h]; -> [n, h]
            return (hidden.unsqueeze(1), *args[1:]), kwargs

        head: Any = model.output_layer
        handle = head.register_forward_pre_hook(keep_loss_positions, with_kwargs=True)
        try:
            logits = self.logits(ids, model)[0].float() / self.config.temperature  # [n, V]
        finally:
            handle.remove()
        picked = logits.gather(-1, ids[:, 1:][sel].unsqueeze(-1)).squeeze(-1)
        out = torch.zeros(ids.shape, dtype=logits.dtype, device=logits.device)
        out[:, 1:][sel] = picked - torch.logsumexp(logits, dim=-1)
        return out

    def logits(self, ids: torch.Tensor, model: torch.nn.Module | None = None) -> torch.Tensor:
        """[B, L] ids -> [B, L, V] logits (causal; right padding never reaches a real token)."""
        n = ids.shape[1]
        pos = torch.arange(n, device=ids.device).unsqueeze(0).expand_as(ids)
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=ids.device), diagonal=1)[None, None]
        out: torch.Tensor = (model or self.model)(ids, pos, attention_mask=mask)
        return out

    def train_step(self, groups: Sequence[Sequence[Episode]]) -> dict[str, float]:
        self._nothing_to_train = not flatten_groups(groups, self.config)  # every rank has the same groups
        if self.pp_size == 1 and self.dp_size == 1 and self.cp_size == 1 and self.ddp is None:
            return super().train_step(groups)  # exactly the torch backend's step
        lr = apply_lr(self.optimizer, self.config, self.step)  # the torch step's schedule (lr_schedule.py)
        return self._with_moe(pipeline_train_step(self, groups)) | {"lr": lr}

    def _sum_over_ranks(self, vec: torch.Tensor) -> torch.Tensor:
        """Summed over the data-parallel ranks (other microbatches) and pipeline stages (other layers)."""
        from megatron.core import parallel_state as ps

        t = vec.to(self.device)
        for size, group in (
            (self.dp_size, ps.get_data_parallel_group()),
            (self.pp_size, ps.get_pipeline_model_parallel_group()),
        ):
            if size > 1:
                torch.distributed.all_reduce(t, group=group)
        return t.cpu()

    def logprobs(self, samples: Sequence[Trajectory | Sample]) -> list[torch.Tensor]:
        if self.pp_size == 1:
            return super().logprobs(samples)
        wrapped = [
            s if isinstance(s, Sample) else Sample(s.token_ids, s.loss_mask, s.logprobs, 0.0, 0.0)
            for s in samples
        ]
        return pipeline_logprobs(self, wrapped)

    def _clip_and_step(self) -> float:
        """Grads reduced (dp, tied copies), global norm over tp x pp, clipped, one AdamW step."""
        if self._nothing_to_train:  # no sample: no update (Adam's momentum would still move weights);
            return 0.0  # every rank skips the collectives below together (they all have the same groups)
        if self.ddp is not None:  # megatron's own: reduce-scatter, tied copies, clip, sharded step
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([self.ddp])
            _ok, norm, _zeros = self.optimizer.step()
            return float(norm or 0.0)
        reduce_grads(self)
        if not any(p.grad is not None for p in self.model.parameters()):
            return 0.0
        norm = grad_norm(self)
        limit = self.config.grad_clip
        if limit is not None and norm > limit:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(limit / (norm + 1e-6))
        self.optimizer.step()
        return norm

    # -- weights -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named weights (gathered over TP ranks and pipeline stages; identical on every rank)."""
        return gather_hf_state(self)

    def export_weights(self, path: str | os.PathLike[str]) -> Path:
        """HF checkpoint dir (model.safetensors + config.json; trainer/export.py: tied tensors once,
        atomic), written by global rank 0; every rank takes part in the gather."""
        state = to_checkpoint(self.state_dict())  # MoE: one tensor per expert, as HF checkpoints are
        target = Path(path)
        if torch.distributed.get_rank() == 0:
            write_hf_dir(state, self.hf_config, target)
        if torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()
        return target

    # -- checkpoints (megatron.checkpoint) -----------------------------------------------------

    def save_checkpoint(self, ckpt_dir: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> Path:
        return save_rank_checkpoint(self, Path(ckpt_dir), extra)

    def load_checkpoint(self, ckpt_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
        return load_rank_checkpoint(self, Path(ckpt_dir))


def _read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every *.safetensors file of an HF checkpoint dir, as one state dict."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model path {str(path)!r}: no *.safetensors file")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
