"""The torch trainer backend: GRPO/PPO steps on an HF causal LM (one process; FSDP2 on GPUs).

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
state_dict for weight sync -> save_checkpoint. `step` is the weight version.

FSDP2: when torch.distributed is initialised with world_size > 1 and CUDA is
available (torchrun), every decoder layer and the root are wrapped with
`fully_shard`. That path is written but untested on these CPU machines.
"""

from __future__ import annotations

import copy
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from miles_env.errors import ConfigError
from miles_env.models import resolve_model
from miles_env.packing import pack_by_budget
from miles_env.trainer.checkpoint import latest_checkpoint, read_checkpoint, write_checkpoint
from miles_env.trainer.config import LoraConfig, TrainerConfig
from miles_env.trainer.losses import group_advantages, microbatch_loss, token_logprobs
from miles_env.types import Episode, Trajectory

__all__ = ["TorchTrainer", "Sample", "flatten_groups", "opd_token_advantages", "pack_microbatches"]


@dataclass(frozen=True, slots=True)
class Sample:
    token_ids: Sequence[int]
    loss_mask: Sequence[int]
    rollout_logprobs: Sequence[float]
    advantage: float
    reward: float
    token_advantages: Sequence[float] | None = None  # OPD: one per token (0 where the mask is 0)


def opd_token_advantages(traj: Trajectory, advantage: float, config: TrainerConfig) -> list[float]:
    """On-policy distillation: reward_weight * A + kl_weight * (teacher - rollout logprob) at each
    sampled token, i.e. minus the per-token reverse-KL estimate log pi(x) - log teacher(x)."""
    teacher = traj.teacher_logprobs
    if teacher is None:
        raise ValueError(f"opd_kl_weight={config.opd_kl_weight}: a trajectory has no teacher_logprobs")
    kl_w, r_w = config.opd_kl_weight, config.opd_reward_weight
    return [
        r_w * advantage + kl_w * (t - r) if m else 0.0
        for m, t, r in zip(traj.loss_mask, teacher, traj.logprobs, strict=True)
    ]


def flatten_groups(groups: Sequence[Sequence[Episode]], config: TrainerConfig) -> list[Sample]:
    """One Sample per Trajectory; advantages are computed over each group's episode rewards.
    Samples with no trainable token, or (by default) with a zero advantage, are dropped: they carry
    no gradient. With token-mean aggregation this also leaves them out of the normaliser (as DAPO's
    dynamic sampling does). Under OPD (`opd_kl_weight > 0`) every sample carries per-token
    advantages (`opd_token_advantages`) and none is skipped: the teacher signal is never zero."""
    opd = config.opd_kl_weight > 0
    out = []
    for group in groups:
        rewards = torch.tensor([ep.score for ep in group], dtype=torch.float64)
        adv = group_advantages(rewards, config.advantage, config.adv_eps).tolist()
        for ep, a in zip(group, adv, strict=True):
            if config.skip_zero_advantage and a == 0.0 and config.kl_coef == 0.0 and not opd:
                continue  # with a KL term the sample still has a gradient (toward the reference)
            for traj in ep.samples:
                if any(traj.loss_mask[1:]):
                    tok = opd_token_advantages(traj, float(a), config) if opd else None
                    out.append(Sample(traj.token_ids, traj.loss_mask, traj.logprobs, float(a), ep.score, tok))
    return out


pack_microbatches = pack_by_budget  # the trainer's name for it (megatron, tests)


@dataclass(frozen=True, slots=True)
class _Batch:
    ids: torch.Tensor  # [B, L] right-padded: causal attention never lets a real token see padding
    mask: torch.Tensor  # [B, L] float, 0 at padding and at position 0 (no prediction there)
    rollout: torch.Tensor  # [B, L]
    adv: torch.Tensor  # [B], or [B, L] when a sample has per-token advantages (OPD)
    lengths: list[int]


class _Metrics:
    def __init__(self) -> None:
        self.pg = self.kl = self.clip = self.tis = self.diff_sum = self.diff_max = 0.0
        self.mask_tokens = 0

    def add(
        self,
        pg: float,
        kl: float,
        clipped: torch.Tensor,
        tis: torch.Tensor | None,
        diff: torch.Tensor,
        mask: torch.Tensor,
    ) -> None:
        on = mask.bool()
        self.pg += pg
        self.kl += kl
        self.clip += float(clipped[on].sum())
        self.tis += float(tis[on].sum()) if tis is not None else float(on.sum())
        d = diff[on].abs()
        self.diff_sum += float(d.sum())
        self.diff_max = max(self.diff_max, float(d.max()) if d.numel() else 0.0)
        self.mask_tokens += int(on.sum())


class TorchTrainer:
    config_type: ClassVar[type[TrainerConfig]] = TrainerConfig  # what trainer/build.py validates options with

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
        self.ref_model = self._frozen_copy() if self.config.kl_coef > 0 else None
        self.sharded = self._maybe_shard()
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

    def _maybe_shard(self) -> bool:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return False
        if self.device.type != "cuda":
            return False
        from torch.distributed.fsdp import fully_shard

        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        return True

    # -- batches -------------------------------------------------------------------------------

    def _collate(self, samples: Sequence[Sample]) -> _Batch:
        lengths = [len(s.token_ids) for s in samples]
        b, width = len(samples), max(lengths)
        ids = torch.zeros(b, width, dtype=torch.long)
        mask = torch.zeros(b, width, dtype=torch.float32)
        rollout = torch.zeros(b, width, dtype=torch.float32)
        for r, s in enumerate(samples):
            n = lengths[r]
            ids[r, :n] = torch.as_tensor(s.token_ids, dtype=torch.long)
            mask[r, :n] = torch.as_tensor(s.loss_mask, dtype=torch.float32)
            rollout[r, :n] = torch.as_tensor(s.rollout_logprobs, dtype=torch.float32)
        mask[:, 0] = 0.0
        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
        if any(s.token_advantages is not None for s in samples):
            adv = adv.unsqueeze(-1).repeat(1, width)
            for r, s in enumerate(samples):
                if s.token_advantages is not None:
                    adv[r, : lengths[r]] = torch.as_tensor(s.token_advantages, dtype=torch.float32)
        dev = self.device
        return _Batch(ids.to(dev), mask.to(dev), rollout.to(dev), adv.to(dev), lengths)

    def _forward_logprobs(
        self, model: Any, ids: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[B, L] logprobs of each next token (column 0 is 0). With `mask`, the LM head runs only
        where mask == 1: agentic samples are mostly prompt, and [tokens x vocab] logits dominate
        both time and memory; positions outside the mask are 0."""
        head = model.get_output_embeddings() if mask is not None else None
        if head is None:
            logits = model(input_ids=ids, use_cache=False).logits
            return token_logprobs(logits, ids, self.config.temperature)
        assert mask is not None
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        sel = mask[:, 1:] > 0  # the logprob of token t comes from position t - 1
        logits = head(hidden[:, :-1][sel]).float() / self.config.temperature
        picked = logits.gather(-1, ids[:, 1:][sel].unsqueeze(-1)).squeeze(-1)
        out = torch.zeros(ids.shape, dtype=logits.dtype, device=logits.device)
        out[:, 1:][sel] = picked - torch.logsumexp(logits, dim=-1)
        return out

    # -- training ------------------------------------------------------------------------------

    def train_step(self, groups: Sequence[Sequence[Episode]]) -> dict[str, float]:
        t0 = time.perf_counter()
        cfg = self.config
        samples = flatten_groups(groups, cfg)
        total_tokens = sum(sum(s.loss_mask[1:]) for s in samples)
        totals = {
            "total_tokens": total_tokens,
            "total_seqs": len(samples),
            "norm_tokens": cfg.loss_norm_tokens,
        }
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        acc = _Metrics()
        n_tokens = 0
        for idx in pack_microbatches([len(s.token_ids) for s in samples], cfg.max_tokens_per_microbatch):
            batch = self._collate([samples[i] for i in idx])
            n_tokens += sum(batch.lengths)
            logp = self._forward_logprobs(self.model, batch.ids, batch.mask)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref = self._forward_logprobs(self.ref_model, batch.ids, batch.mask)
            m = microbatch_loss(logp, batch.rollout, batch.adv, batch.mask, ref, cfg, totals)
            m.loss.backward()
            acc.add(m.pg, m.kl, m.clipped, m.weights, m.old - batch.rollout, batch.mask)
        grad_norm = self._clip_and_step()
        self.step += 1
        dt = time.perf_counter() - t0
        denom = max(acc.mask_tokens, 1)
        return {
            "step": float(self.step),
            "loss": acc.pg + cfg.kl_coef * acc.kl,
            "pg_loss": acc.pg,
            "kl": acc.kl,
            "clip_frac": acc.clip / denom,
            "tis_mean": acc.tis / denom,
            "grad_norm": grad_norm,
            # over every episode of the step, skipped ones included: it tracks the policy, not the batch
            "reward_mean": sum(ep.score for g in groups for ep in g) / max(sum(len(g) for g in groups), 1),
            "samples": float(len(samples)),
            "tokens": float(n_tokens),
            "loss_tokens": float(acc.mask_tokens),
            "tokens_per_s": n_tokens / dt if dt > 0 else 0.0,
            "step_time_s": dt,
            # NaN when every group had a single reward (nothing trained, nothing to compare)
            "logprob_diff_mean": acc.diff_sum / denom if acc.mask_tokens else float("nan"),
            "logprob_diff_max": acc.diff_max if acc.mask_tokens else float("nan"),
            "skipped_samples": float(sum(len(ep.samples) for g in groups for ep in g) - len(samples)),
        } | self._lora_metrics()

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
        return float(norm)

    @torch.no_grad()
    def logprobs(self, samples: Sequence[Trajectory | Sample]) -> list[torch.Tensor]:
        """Per-sample [L] logprobs under the current weights (position 0 is 0), on the CPU."""
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
        """What a full sync moves: every distinct weight tensor of the base model (adapter excluded)."""
        seen: set[int] = set()
        total = 0
        for name, p in self.model.named_parameters():
            if ".lora_" not in name and p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total

    def export_adapter(self, path: str | os.PathLike[str]) -> Path:
        """Write the LoRA adapter as a PEFT adapter dir (what vLLM / SGLang / the hf engine load)."""
        from miles_env.trainer.lora import save_adapter

        if self.config.lora is None:
            raise ConfigError("export_adapter: trainer.lora is not set")
        return save_adapter(self.model, self.config.lora, Path(path), str(self.model_path))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full, HF-named weights (gathered to every rank's CPU under FSDP2); with LoRA, merged."""
        if self.config.lora is not None:
            from miles_env.trainer.lora import merged_state

            return merged_state(self.model)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            full: dict[str, torch.Tensor] = get_model_state_dict(self.model, options=opts)  # type: ignore[assignment]
            return full
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def export_weights(self, path: str | os.PathLike[str]) -> Path:
        """Write an HF checkpoint dir (model.safetensors + config.json) for update_weights_from_disk.
        Tied tensors are stored once, as save_pretrained does. Atomic: tmp dir, then rename."""
        from safetensors.torch import save_file

        target = Path(path)
        tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        seen: set[int] = set()
        tensors = {}
        for name, t in self.state_dict().items():
            if t.data_ptr() in seen:
                continue  # tied (lm_head = embed_tokens)
            seen.add(t.data_ptr())
            tensors[name] = t.contiguous().cpu()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        self.model.config.to_json_file(str(tmp / "config.json"))
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
        return target

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, ckpt_dir: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> Path:
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict(), "rng": rng}
        if self.config.lora is not None:  # the base is model_path, unchanged: store the adapter only
            from miles_env.trainer.lora import adapter_state

            state["adapter"] = {k: v.cpu() for k, v in adapter_state(self.model).items()}
        else:
            state["model"] = self.state_dict()
        meta = {"extra": extra or {}, "model_path": str(self.model_path)}
        return write_checkpoint(Path(ckpt_dir), self.step, state, meta, self.config.keep_checkpoints)

    def load_checkpoint(self, ckpt_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
        """Restore the newest checkpoint under `ckpt_dir` (or that step dir itself); None if none."""
        root = Path(ckpt_dir)
        path = root if (root / "trainer.json").is_file() else latest_checkpoint(root)
        if path is None:
            return None
        state, meta = read_checkpoint(path)
        if self.config.lora is not None or "adapter" in state:
            from miles_env.trainer.lora import load_adapter_state

            if self.config.lora is None or "adapter" not in state:
                raise ConfigError(f"checkpoint {str(path)!r}: trainer.lora must match the run that wrote it")
            load_adapter_state(self.model, state["adapter"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self.step = int(meta["step"])
        extra: dict[str, Any] = meta["extra"]
        return extra
