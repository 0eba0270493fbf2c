"""The torch trainer backend: GRPO/PPO steps on an HF causal LM (one process, or FSDP2 under torchrun).

Concept: `train_step(groups)` turns leased GRPO groups into samples (one per
Trajectory, carrying its episode's group-normalised advantage), packs them into
right-padded microbatches under a token budget, accumulates gradients with
global denominators (so the step equals one big batch), and takes one AdamW step.

Invariants: logprobs are log_softmax(logits / T) of the next token, the engine's
convention, so on identical weights the trainer reproduces the rollout logprobs
(the "zero-KL check", reported every step as logprob_diff_*). Loss flows only
through tokens with loss_mask = 1. One optimizer step per train_step, so the
PPO "old" logprobs are the detached current ones (ratio 1 at the step); the gap
to the engine is corrected by truncated importance sampling (tis_cap).

LoRA (`trainer.lora`, trainer/lora.py): PEFT adapters are injected into the model in place and
are its only trainable parameters; the optimizer, checkpoints and weight sync carry only them
(`export_adapter`), while `state_dict`/`export_weights` give merged, HF-named full weights.

Lifecycle: build -> (load_checkpoint) -> train_step* with export_weights /
state_dict for weight sync -> save_checkpoint. `step` is the weight version. What leaves for disk
has its own homes: checkpoints in torch_checkpoint.py, HF folders in export.py.

FSDP2 (trainer/fsdp.py): under torchrun with world_size > 1, the trainer joins (or creates: gloo
on CPU, nccl on CUDA) the default process group and `fully_shard`s every decoder layer and the root.
It is data parallel: every rank gets the same groups (trainer/ranks.py's Leader), trains
`samples[rank::world]`, and the summed gradient and reduced metrics are the single process's.
`state_dict`, `export_*` and checkpoints gather full tensors to rank 0, which writes one process's
format (a checkpoint resumes on any world size). Tested on CPU with gloo (tests/test_fsdp2.py:
2 ranks vs 1 process, full and LoRA, resume 2 -> 1 and 1 -> 2, `torchrun miles-env train`); the
nccl/CUDA path is the same code but has never run on a GPU here. The KL reference model
(kl_coef > 0) is not sharded: each rank holds a full copy.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor

from miles_env.errors import ConfigError
from miles_env.models import resolve_model
from miles_env.trainer.batch import Batch, collate, masked_logprobs
from miles_env.trainer.config import LoraConfig, TrainerConfig
from miles_env.trainer.export import write_hf_dir
from miles_env.trainer.fsdp import World, deal, full_state, init_world, merged_lora_state, shard
from miles_env.trainer.losses import microbatch_loss, token_logprobs
from miles_env.trainer.lr_schedule import apply_lr
from miles_env.trainer.moe import MoeAux, moe_shape, routers
from miles_env.trainer.samples import (
    Sample,
    StepMetrics,
    flatten_groups,
    opd_token_advantages,
    pack_microbatches,
)
from miles_env.trainer.torch_checkpoint import load_torch_checkpoint, save_torch_checkpoint
from miles_env.types import Episode, Trajectory
from miles_env.weight_layout import to_checkpoint

__all__ = [
    "TorchTrainer",
    "Sample",
    "flatten_groups",
    "masked_logprobs",
    "opd_token_advantages",
    "pack_microbatches",
]

_Metrics = StepMetrics  # the megatron backend's name for it


class TorchTrainer:
    config_type: ClassVar[type[TrainerConfig]] = TrainerConfig  # what trainer/build.py validates options with
    world: World = World()  # one process unless __init__ finds a torchrun world (a subclass may not)

    def __init__(self, model_path: str | os.PathLike[str], config: TrainerConfig | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM

        self.config = config or TrainerConfig()
        torch.manual_seed(self.config.seed)
        self.model_path = resolve_model(model_path)
        self.device = self._pick_device()
        dtype = getattr(torch, self.config.dtype)
        model: Any = AutoModelForCausalLM.from_pretrained(str(self.model_path), dtype=dtype)
        if self.config.lora is not None:
            from miles_env.trainer.lora import attach

            attach(model, self.config.lora)
        self.model = model.to(self.device)
        shape = moe_shape(model.config)
        self.moe = MoeAux(shape, self.config.moe_aux_loss_coef, len(routers(model))) if shape else None
        self.ref_model = self._frozen_copy() if self.config.kl_coef > 0 else None
        self.world = World(*init_world(self.device))
        self.sharded = self.world.sharded
        if self.sharded:  # after LoRA: the adapters are sharded with the layers they sit in
            shard(self.model, self.device, self.world.world, {"masked_logprobs": masked_logprobs})
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # LoRA: the adapter only
            lr=self.config.lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
            eps=self.config.adam_eps,
            fused=self.config.fused_adamw,
        )
        self.step = 0

    def _pick_device(self) -> torch.device:
        if self.config.device != "auto":
            return torch.device(self.config.device)
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")

    def _frozen_copy(self) -> torch.nn.Module:
        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    # -- batches -------------------------------------------------------------------------------

    def _collate(self, samples: Sequence[Sample]) -> Batch:
        return collate(samples, self.device)

    def _forward_logprobs(
        self, model: Any, ids: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[B, L] logprobs of each next token (column 0 is 0). With `mask`, the LM head runs only
        where mask == 1: agentic samples are mostly prompt, and [tokens x vocab] logits dominate
        both time and memory; positions outside the mask are 0."""
        T = self.config.temperature
        if mask is None or model.get_output_embeddings() is None:
            logits = model(input_ids=ids, use_cache=False).logits
            return token_logprobs(logits, ids, T)
        if model is self.model and self.sharded:  # FSDP2 gathers the root's weights for it
            out: torch.Tensor = model.masked_logprobs(ids, mask, T)
            return out
        return masked_logprobs(model, ids, mask, T)

    # -- training ------------------------------------------------------------------------------

    def train_step(self, groups: Sequence[Sequence[Episode]]) -> dict[str, float]:
        t0 = time.perf_counter()
        cfg = self.config
        lr = apply_lr(self.optimizer, cfg, self.step)  # this update's (trainer/lr_schedule.py)
        samples = flatten_groups(groups, cfg)
        total_tokens = sum(sum(s.loss_mask[1:]) for s in samples)
        totals = {
            "total_tokens": total_tokens,
            "total_seqs": len(samples),
            "norm_tokens": cfg.loss_norm_tokens,
        }
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        acc = StepMetrics()
        lengths = [len(s.token_ids) for s in samples]
        if self.moe is not None:
            self.moe.begin(sum(lengths))
        budget, rank, world = cfg.max_tokens_per_microbatch, self.world.rank, self.world.world
        for idx in deal(lengths, budget, pack_microbatches, rank, world):
            real = idx is not None  # None: this rank's zero-weight filler (FSDP2's passes are collective)
            rows = (
                [samples[i] for i in idx]
                if idx is not None
                else [min(samples, key=lambda s: len(s.token_ids))]
            )
            batch = self._collate(rows)
            with self._moe_tap(batch, real, rows):
                logp = self._forward_logprobs(self.model, batch.ids, batch.mask)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref = self._forward_logprobs(self.ref_model, batch.ids, batch.mask)
            m = microbatch_loss(logp, batch.rollout, batch.adv, batch.mask, ref, cfg, totals)
            (m.loss if real else m.loss * 0.0).backward()
            if real:
                acc.add(
                    m.pg, m.kl, m.clipped, m.weights, m.old - batch.rollout, batch.mask, sum(batch.lengths)
                )
        if self.sharded:
            acc.reduce(self.device)
        n_tokens = acc.tokens
        grad_norm = self._clip_and_step()
        self.step += 1
        dt = time.perf_counter() - t0
        denom = max(acc.mask_tokens, 1)
        return self._with_moe(
            {
                "step": float(self.step),
                "lr": lr,
                "loss": acc.pg + cfg.kl_coef * acc.kl,
                "pg_loss": acc.pg,
                "kl": acc.kl,
                "clip_frac": acc.clip / denom,
                "tis_mean": acc.tis / denom,
                "grad_norm": grad_norm,
                # over every episode of the step, skipped ones included: it tracks the policy, not the batch
                "reward_mean": sum(ep.score for g in groups for ep in g)
                / max(sum(len(g) for g in groups), 1),
                "samples": float(len(samples)),
                "tokens": float(n_tokens),
                "loss_tokens": float(acc.mask_tokens),
                "tokens_per_s": n_tokens / dt if dt > 0 else 0.0,
                "step_time_s": dt,
                # NaN when every group had a single reward (nothing trained, nothing to compare)
                "logprob_diff_mean": acc.diff_sum / denom if acc.mask_tokens else float("nan"),
                "logprob_diff_max": acc.diff_max if acc.mask_tokens else float("nan"),
                "skipped_samples": float(sum(len(ep.samples) for g in groups for ep in g) - len(samples)),
            }
            | self._lora_metrics()
        )

    def _moe_tap(
        self, batch: Any, real: bool = True, rows: Sequence[Sample] = ()
    ) -> contextlib.AbstractContextManager[Any]:
        """The MoE router tap around a microbatch's forward (trainer/moe.py; `rows` with the rollout's
        routing are compared against this forward's: moe_router_agreement); nothing for dense models."""
        if self.moe is None:
            return contextlib.nullcontext()
        return self.moe.tap(self.model, batch.lengths, batch.ids.shape[1], real, self.device, rows)

    def _with_moe(self, metrics: dict[str, float]) -> dict[str, float]:
        """A MoE step's metrics get moe_* (trainer/moe.py) and `loss` its coef x aux term."""
        if self.moe is None:
            return metrics
        moe = self.moe.metrics(self._sum_over_ranks)
        return metrics | moe | {"loss": metrics["loss"] + moe["moe_aux_coef"] * moe["moe_aux_loss"]}

    def _sum_over_ranks(self, vec: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return vec
        t = vec.to(self.device)  # nccl reduces CUDA tensors only
        torch.distributed.all_reduce(t)
        return t.cpu()

    def _lora_metrics(self) -> dict[str, float]:
        if self.config.lora is None:
            return {}
        from miles_env.trainer.lora import param_share

        return {"lora_param_share": param_share(self.model)}

    def _clip_and_step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        limit = self.config.grad_clip if self.config.grad_clip is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
        self.optimizer.step()
        if isinstance(norm, DTensor):  # sharded grads: the norm over every rank's shard
            norm = norm.full_tensor()
        return float(norm)

    @torch.no_grad()
    def logprobs(self, samples: Sequence[Trajectory | Sample]) -> list[torch.Tensor]:
        """Per-sample [L] logprobs under the current weights (position 0 is 0), on the CPU. Sharded:
        every rank computes every sample (the forward is collective)."""
        self.model.eval()
        wrapped = [
            s if isinstance(s, Sample) else Sample(s.token_ids, s.loss_mask, s.logprobs, 0.0, 0.0)
            for s in samples
        ]
        out: list[torch.Tensor] = [torch.empty(0)] * len(wrapped)
        for idx in pack_microbatches(
            [len(s.token_ids) for s in wrapped], self.config.max_tokens_per_microbatch
        ):
            batch = self._collate([wrapped[i] for i in idx])
            logp = self._forward_logprobs(self.model, batch.ids).float().cpu()
            for row, i in enumerate(idx):
                out[i] = logp[row, : batch.lengths[row]]
        return out

    # -- weights -------------------------------------------------------------------------------

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.model.named_parameters()

    @property
    def lora(self) -> LoraConfig | None:
        return self.config.lora

    def full_weight_bytes(self) -> int:
        """What a full sync moves: every distinct weight tensor of the base model (adapter excluded).
        A sharded parameter counts its full size (a DTensor's numel is global; its data_ptr is 0)."""
        seen: set[int] = set()
        total = 0
        for name, p in self.model.named_parameters():
            key = id(p) if isinstance(p, DTensor) else p.data_ptr()
            if ".lora_" not in name and key not in seen:
                seen.add(key)
                total += p.numel() * p.element_size()
        return total

    def _adapter(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's full tensors on the CPU (collective when sharded: each is gathered)."""
        from miles_env.trainer.lora import adapter_state

        return {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).cpu()
            for k, v in adapter_state(self.model).items()
        }

    def export_adapter(self, path: str | os.PathLike[str]) -> Path:
        """Write the LoRA adapter as a PEFT adapter dir (what vLLM / SGLang / the hf engine load).
        Sharded: every rank gathers, rank 0 writes."""
        from miles_env.trainer.lora import save_adapter

        if self.config.lora is None:
            raise ConfigError("export_adapter: trainer.lora is not set")
        state = self._adapter()
        if self.world.rank != 0:
            return Path(path)
        return save_adapter(self.model, self.config.lora, Path(path), str(self.model_path), state)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full, HF-named weights; with LoRA, merged. Sharded: gathered to rank 0's CPU (tied tensors
        stay one tensor), {} on the other ranks, which must all enter the call."""
        if self.sharded:
            full = full_state(self.model)
            return merged_lora_state(self.model, full) if self.config.lora is not None else full
        if self.config.lora is not None:
            from miles_env.trainer.lora import merged_state

            return merged_state(self.model)
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def export_weights(self, path: str | os.PathLike[str]) -> Path:
        """Write an HF checkpoint dir (model.safetensors + config.json) for update_weights_from_disk
        (trainer/export.py: tied tensors once, atomic). Sharded: every rank gathers, rank 0 writes."""
        target = Path(path)
        state = to_checkpoint(self.state_dict())  # MoE: one tensor per expert, as HF checkpoints are
        if self.world.rank != 0:
            return target
        return write_hf_dir(state, self.model.config, target)

    # -- checkpoints (torch_checkpoint.py) ---------------------------------------------------

    def save_checkpoint(self, ckpt_dir: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> Path:
        """One process's format whatever the world size: full (or adapter) weights, the optimizer
        state keyed by parameter index, the RNG. Sharded: every rank gathers, rank 0 writes."""
        return save_torch_checkpoint(self, Path(ckpt_dir), extra)

    def load_checkpoint(self, ckpt_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
        """Restore the newest checkpoint under `ckpt_dir` (or that step dir itself); None if none.
        Sharded: rank 0 reads it and broadcasts (any world size resumes any other's checkpoint)."""
        return load_torch_checkpoint(self, Path(ckpt_dir))
