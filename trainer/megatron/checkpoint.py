"""Checkpoints of the megatron backend: each rank's own megatron tensors and optimizer state.

Concept: a checkpoint is one dir per distinct shard of the model: per tensor-parallel rank, pipeline
stage and (MoE) expert-parallel rank, each holding that rank's megatron-named tensors, its optimizer
state and the RNG (`trainer/checkpoint.py`'s step dirs). Replicas do not write: data-parallel rank 0
does (with expert parallelism, the first of the ranks holding the same experts; context-parallel
ranks are replicas too). With megatron's DistributedOptimizer the Adam shards are gathered to each
optimizer's own data-parallel rank 0 on save and scattered from it on load (collectives: every rank
calls both).

Invariant: a resumed trainer takes exactly the step the uninterrupted one takes (tests/test_megatron_pp.py,
_dp.py, _ep.py); the optimizer kind must match the one that saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from miles_env.trainer.checkpoint import latest_checkpoint, read_checkpoint, write_checkpoint
from miles_env.trainer.megatron.stage import StageTrainer

__all__ = ["load_rank_checkpoint", "rank_dir", "save_rank_checkpoint"]


def rank_dir(tr: StageTrainer, root: Path) -> Path:
    """This rank's checkpoint dir under `root` (one per tp rank / pipeline stage / ep rank)."""
    if tr.ep_size > 1:  # each ep rank holds its own experts (and a copy of the dense weights)
        return root / f"tp{tr.tp_rank}_pp{tr.pp_rank}_ep{tr.ep_rank}"
    if tr.pp_size > 1:
        return root / f"tp{tr.tp_rank}_pp{tr.pp_rank}"
    return root if tr.tp_size == 1 else root / f"tp{tr.tp_rank}"


def _writes(tr: StageTrainer) -> bool:
    """Data-parallel rank 0 writes (the replicas are identical); with expert parallelism the first
    of the ranks holding the same experts does."""
    from megatron.core import parallel_state as ps

    first = (ps.get_expert_data_parallel_rank() if tr.ep_size > 1 else tr.dp_rank) == 0
    return first and tr.cp_rank == 0  # cp ranks hold the same weights


def _sharded_optimizers(tr: StageTrainer) -> list[Any]:
    return list(getattr(tr.optimizer, "chained_optimizers", [tr.optimizer]))


def save_rank_checkpoint(tr: StageTrainer, ckpt_dir: Path, extra: dict[str, Any] | None = None) -> Path:
    """This rank's megatron tensors and optimizer state (one dir per TP rank / pipeline stage),
    written by data-parallel rank 0 (the replicas are identical). With the distributed optimizer,
    its Adam shards are first gathered to dp rank 0 (a collective: every rank calls this)."""
    param_states = None
    if tr.ddp is not None:
        param_states = [o.get_parameter_state_dp_zero() for o in _sharded_optimizers(tr)]
    if not _writes(tr):
        torch.distributed.barrier()
        return rank_dir(tr, ckpt_dir)
    local = {k: v.detach() for k, v in tr.model.state_dict().items() if isinstance(v, torch.Tensor)}
    state = {
        "model": local,
        "optimizer": tr.optimizer.state_dict(),
        "optimizer_shards": param_states,
        "rng": {"torch": torch.get_rng_state()},
    }
    meta = {
        "extra": extra or {},
        "model_path": str(tr.model_path),
        "tp": tr.tp_size,
        "pp": tr.pp_size,
        "ep": tr.ep_size,
        "distributed_optimizer": tr.ddp is not None,
        "backend": "megatron",
    }
    path = write_checkpoint(rank_dir(tr, ckpt_dir), tr.step, state, meta, tr.config.keep_checkpoints)
    if torch.distributed.get_world_size() > 1:  # every rank passes one barrier, writer or not
        torch.distributed.barrier()
    return path


def load_rank_checkpoint(tr: StageTrainer, ckpt_dir: Path) -> dict[str, Any] | None:
    """Every rank reads its (tp, pp) dir; with the distributed optimizer dp rank 0 scatters the
    Adam shards (a collective). The optimizer kind must match the one that saved."""
    root = rank_dir(tr, ckpt_dir)
    path = root if (root / "trainer.json").is_file() else latest_checkpoint(root)
    if path is None:
        return None
    state, meta = read_checkpoint(path)
    if bool(meta.get("distributed_optimizer", False)) != (tr.ddp is not None):
        raise ValueError(
            f"checkpoint {str(path)!r}: distributed_optimizer={meta.get('distributed_optimizer', False)}, "
            f"this trainer has {tr.ddp is not None}"
        )
    tr.model.load_state_dict(state["model"], strict=False)
    tr.optimizer.load_state_dict(state["optimizer"])
    if tr.ddp is not None:
        for opt, shard in zip(_sharded_optimizers(tr), state["optimizer_shards"], strict=True):
            # torch AdamW's per-param "step" (restored by load_state_dict above) is not in the saved
            # shards and megatron's loader copies every state key: set it aside meanwhile; megatron
            # restores it as ONE tensor shared by every param, which AdamW would then bump once per
            # param: give each its own copy. fp32 main params are views of the model's leaf params:
            # copy without autograd.
            inner = opt.optimizer.state
            steps = {p: st.pop("step") for p, st in inner.items() if "step" in st}
            with torch.no_grad():
                # each optimizer's own data-parallel rank 0 holds its shards (experts: expert-dp)
                opt.load_parameter_state_from_dp_zero(shard if opt.data_parallel_group.rank() == 0 else None)
            for p, step in steps.items():
                inner[p]["step"] = step.clone()
    torch.set_rng_state(state["rng"]["torch"])
    tr.step = int(meta["step"])
    extra: dict[str, Any] = meta["extra"]
    return extra
