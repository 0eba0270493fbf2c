"""The megatron trainer backend: the torch backend's step on a megatron-core GPTModel.

Concept: `MegatronTrainer` builds a megatron-core GPTModel (local layer spec, no
TransformerEngine) from an HF Llama/Qwen config, loads the HF weights through
`megatron_convert`, and reuses TorchTrainer's step verbatim (flatten groups, pack
microbatches, the same pure losses from `losses.py`, one AdamW step). Only the
forward, the gradient clipping (norm reduced over tensor-parallel ranks) and the
weight export differ, so the two backends are interchangeable.

Invariants: `state_dict()` / `export_weights()` give full HF-named tensors (gathered over
tensor-parallel ranks), so the engine never sees megatron names; HF -> megatron -> HF is
bit-exact; logits are gathered over the vocabulary (parallel_output=False) so logprobs
use the same code as the torch backend.

Parallelism: tensor parallel (tp); on CPU a gloo process group and the two shims of
`megatron_cpu_shims` (TP=2 tested under torchrun on CPU; on GPUs, nccl: TP=1 checked once on
an H200, TP>1 untested). Every rank is given the same groups (no data parallel: world size
must equal tp), so megatron's distributed optimizer (which shards over data-parallel ranks)
has nothing to shard and is not used; pipeline parallel is not wired (pp > 1 is refused).

Lifecycle: as TorchTrainer: build -> (load_checkpoint) -> train_step* -> state_dict /
export_weights for weight sync -> save_checkpoint.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from miles_env.trainer.checkpoint import latest_checkpoint, read_checkpoint, write_checkpoint
from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.losses import token_logprobs
from miles_env.trainer.megatron_convert import (
    hf_to_megatron,
    megatron_to_hf,
    model_shape,
    shard,
    transformer_config,
)
from miles_env.trainer.megatron_cpu_shims import apply_cpu_shims, init_distributed
from miles_env.trainer.torch_backend import TorchTrainer
from pydantic import Field

from miles_env.models import resolve_model

__all__ = ["MegatronTrainer", "MegatronTrainerConfig"]


class MegatronTrainerConfig(TrainerConfig):
    """TrainerConfig plus megatron's parallel layout."""

    tp: int = Field(1, ge=1, description="tensor-parallel size (torchrun world size must equal tp * pp)")
    pp: int = Field(1, ge=1, description="pipeline-parallel size (not wired yet: must be 1)")


class MegatronTrainer(TorchTrainer):
    config: MegatronTrainerConfig

    def __init__(self, model_path: str | os.PathLike[str], config: TrainerConfig | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig

        cfg = config if isinstance(config, MegatronTrainerConfig) else MegatronTrainerConfig(
            **(config.model_dump() if config is not None else {})
        )  # fmt: skip
        if cfg.pp != 1:
            raise ValueError(
                f"pp={cfg.pp}: pipeline parallel is not wired in the megatron backend yet; use pp=1"
            )
        self.config = cfg
        torch.manual_seed(cfg.seed)
        self.model_path = resolve_model(model_path)
        self.hf_config = AutoConfig.from_pretrained(str(self.model_path))
        self.shape = model_shape(self.hf_config)
        self.device = self._pick_device()
        apply_cpu_shims()
        init_distributed(cfg.tp, cfg.pp)
        world = torch.distributed.get_world_size()
        if world != cfg.tp * cfg.pp:
            raise ValueError(
                f"world size {world} != tp * pp = {cfg.tp * cfg.pp}: data parallel is not wired yet"
            )
        if torch.cuda.is_available():  # megatron's model-parallel CUDA RNG streams (the CPU shim skips them)
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(cfg.seed)
        from megatron.core import parallel_state as ps

        self.tp_rank, self.tp_size = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
        )
        self.model = self._build_model()
        self.ref_model = self._frozen_copy() if cfg.kl_coef > 0 else None
        self.sharded = False
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.lr,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
            eps=cfg.adam_eps,
            fused=cfg.fused_adamw,
        )
        self.step = 0

    def _build_model(self) -> torch.nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        dtype = getattr(torch, self.config.dtype)
        s = self.shape
        tcfg = transformer_config(s, dtype, tensor_model_parallel_size=self.tp_size)
        model = GPTModel(
            tcfg,
            get_gpt_layer_local_spec(qk_layernorm=s.qk_norm),
            vocab_size=s.vocab,
            max_sequence_length=s.max_positions,
            position_embedding_type="rope",
            rotary_base=int(s.rope_theta) if float(s.rope_theta).is_integer() else s.rope_theta,  # type: ignore[arg-type]
            share_embeddings_and_output_weights=s.tied,
            parallel_output=False,  # gather logits over the vocab: losses.token_logprobs as is
        )
        full = hf_to_megatron(_read_hf_weights(self.model_path), s)
        local = {k: shard(k, v, self.tp_rank, self.tp_size).to(dtype) for k, v in full.items()}
        missing, unexpected = model.load_state_dict(local, strict=False)
        real_missing = [k for k in missing if not k.endswith("_extra_state")]
        if real_missing or unexpected:
            raise ValueError(f"HF -> megatron: missing {real_missing[:4]}, unexpected {unexpected[:4]}")
        return model.to(self.device)

    def _frozen_copy(self) -> torch.nn.Module:
        ref = copy.deepcopy(self.model).eval()
        ref.requires_grad_(False)
        return ref

    # -- forward -------------------------------------------------------------------------------

    def _forward_logprobs(
        self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[B, L] logprobs of each next token (column 0 is 0). With `mask`, as the torch backend, the
        LM head runs only where mask == 1 (a pre-hook on megatron's output layer keeps just those
        hidden states); positions outside the mask are 0."""
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

    def _clip_and_step(self) -> float:
        """Global grad norm: tensor-parallel shards summed over TP ranks, replicated tensors once."""
        grads = [(p.grad, bool(getattr(p, "tensor_model_parallel", False))) for p in self.model.parameters()]
        present = [(g, tp) for g, tp in grads if g is not None]
        if not present:
            return 0.0
        sharded = sum((float(g.float().pow(2).sum()) for g, tp in present if tp), 0.0)
        replicated = sum((float(g.float().pow(2).sum()) for g, tp in present if not tp), 0.0)
        if self.tp_size > 1:
            from megatron.core import parallel_state as ps

            t = torch.tensor([sharded], dtype=torch.float64)
            torch.distributed.all_reduce(t, group=ps.get_tensor_model_parallel_group())
            sharded = float(t)
        norm = (sharded + replicated) ** 0.5
        limit = self.config.grad_clip
        if limit is not None and norm > limit:
            for g, _ in present:
                g.mul_(limit / (norm + 1e-6))
        self.optimizer.step()
        return norm

    # -- weights -------------------------------------------------------------------------------

    def megatron_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (TP-gathered) megatron-named tensors, detached."""
        from miles_env.trainer.megatron_convert import unshard

        local = {k: v.detach() for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)}
        if self.tp_size == 1:
            return local
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        full = {}
        for name, t in local.items():
            pieces = [torch.empty_like(t) for _ in range(self.tp_size)]
            torch.distributed.all_gather(pieces, t.contiguous(), group=group)
            full[name] = unshard(name, pieces)
        return full

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named weights (identical on every TP rank)."""
        return megatron_to_hf(self.megatron_state_dict(), self.shape)

    def export_weights(self, path: str | os.PathLike[str]) -> Path:
        """HF checkpoint dir (model.safetensors + config.json), tied tensors once, written by TP rank 0
        atomically (tmp dir, then rename); every rank takes part in the gather."""
        from safetensors.torch import save_file

        state = self.state_dict()
        target = Path(path)
        if self.tp_rank == 0:
            tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            seen: set[int] = set()
            tensors = {}
            for name, t in state.items():
                if t.data_ptr() in seen:
                    continue  # tied (lm_head = embed_tokens)
                seen.add(t.data_ptr())
                tensors[name] = t.contiguous().cpu()
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            self.hf_config.to_json_file(str(tmp / "config.json"))
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
        if self.tp_size > 1:
            torch.distributed.barrier()
        return target

    # -- checkpoints ---------------------------------------------------------------------------

    def _rank_dir(self, ckpt_dir: str | os.PathLike[str]) -> Path:
        root = Path(ckpt_dir)
        return root if self.tp_size == 1 else root / f"tp{self.tp_rank}"

    def save_checkpoint(self, ckpt_dir: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> Path:
        """This rank's megatron tensors and optimizer state (one dir per TP rank when tp > 1)."""
        local = {k: v.detach() for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)}
        state = {
            "model": local,
            "optimizer": self.optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
        }
        meta = {
            "extra": extra or {},
            "model_path": str(self.model_path),
            "tp": self.tp_size,
            "backend": "megatron",
        }
        return write_checkpoint(
            self._rank_dir(ckpt_dir), self.step, state, meta, self.config.keep_checkpoints
        )

    def load_checkpoint(self, ckpt_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
        root = self._rank_dir(ckpt_dir)
        path = root if (root / "trainer.json").is_file() else latest_checkpoint(root)
        if path is None:
            return None
        state, meta = read_checkpoint(path)
        self.model.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        self.step = int(meta["step"])
        extra: dict[str, Any] = meta["extra"]
        return extra


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
