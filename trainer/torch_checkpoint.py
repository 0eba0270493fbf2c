"""Checkpoints of the torch backend: one process's format, whatever the world size.

Concept: a step dir (trainer/checkpoint.py: atomic, rotating) holds the full HF-named weights, or
with `trainer.lora` the adapter's tensors only (the base is `model_path`, unchanged), the optimizer
state keyed by parameter index (`optimizer.state_dict()`'s own format; under FSDP2 gathered from
the shards, trainer/fsdp.py) and the RNG. Under torchrun every rank gathers and rank 0 writes; on
load rank 0 reads and broadcasts what every rank needs, and each rank loads the full state into
its shards, so a checkpoint written by N ranks resumes on M (tests/test_fsdp2.py).

Invariant: a checkpoint resumes only a trainer with the same `trainer.lora` (the same adapter
tensor names); the resumed trainer's step, optimizer state and RNG are the saved ones.

`TorchTrainer.save_checkpoint` / `load_checkpoint` (torch_backend.py) pass themselves in, seen
through `CheckpointedTrainer`, so this module does not import the backend that imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from miles_env.errors import ConfigError
from miles_env.trainer.checkpoint import latest_checkpoint, read_checkpoint, write_checkpoint
from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.fsdp import World, full_optimizer_state, load_full_model_state, load_optimizer_state

__all__ = ["CheckpointedTrainer", "load_torch_checkpoint", "save_torch_checkpoint"]


class CheckpointedTrainer(Protocol):
    """What a torch-backend checkpoint reads from and restores into a trainer."""

    config: TrainerConfig
    model: Any
    world: World
    sharded: bool
    model_path: Path
    step: int

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def _adapter(self) -> dict[str, torch.Tensor]: ...


def save_torch_checkpoint(tr: CheckpointedTrainer, ckpt_dir: Path, extra: dict[str, Any] | None) -> Path:
    """Full (or adapter) weights, the optimizer state keyed by parameter index, the RNG. Sharded:
    every rank gathers, rank 0 writes."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    optim = full_optimizer_state(tr.model, tr.optimizer) if tr.sharded else tr.optimizer.state_dict()
    state: dict[str, Any] = {"optimizer": optim, "rng": rng}
    if tr.config.lora is not None:  # the base is model_path, unchanged: store the adapter only
        state["adapter"] = tr._adapter()
    else:
        state["model"] = tr.state_dict()
    if tr.world.rank != 0:
        return ckpt_dir / f"step_{tr.step:08d}"
    meta = {"extra": extra or {}, "model_path": str(tr.model_path)}
    return write_checkpoint(ckpt_dir, tr.step, state, meta, tr.config.keep_checkpoints)


def load_torch_checkpoint(tr: CheckpointedTrainer, ckpt_dir: Path) -> dict[str, Any] | None:
    """Restore the newest checkpoint under `ckpt_dir` (or that step dir itself); None if none.
    Sharded: rank 0 reads it and broadcasts (any world size resumes any other's checkpoint)."""
    state, head = _read(ckpt_dir) if tr.world.rank == 0 else ({}, None)
    head = tr.world.broadcast(head)
    if head is None:
        return None
    meta, rng, adapter_keys, where = head
    if (tr.config.lora is not None) != (adapter_keys is not None):
        raise ConfigError(f"checkpoint {where!r}: trainer.lora must match the run that wrote it")
    if adapter_keys is not None:
        from miles_env.trainer.lora import adapter_state, load_adapter_state

        if missing := sorted(set(adapter_state(tr.model)) ^ set(adapter_keys)):
            raise ConfigError(f"checkpoint adapter does not match trainer.lora: {missing[0]!r} differs")
    weights = state.get("adapter", state.get("model", {}))
    if tr.sharded:
        load_full_model_state(tr.model, weights, strict=adapter_keys is None)
        load_optimizer_state(tr.model, tr.optimizer, state.get("optimizer", {}))
    else:
        if adapter_keys is not None:
            load_adapter_state(tr.model, weights)
        else:
            tr.model.load_state_dict(weights)
        tr.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    tr.step = int(meta["step"])
    extra: dict[str, Any] = meta["extra"]
    return extra


def _read(root: Path) -> tuple[dict[str, Any], tuple[Any, ...] | None]:
    """The newest checkpoint's state and what every rank needs of it (meta, RNG, adapter names or
    None, path); ({}, None) when there is none."""
    path = root if (root / "trainer.json").is_file() else latest_checkpoint(root)
    if path is None:
        return {}, None
    state, meta = read_checkpoint(path)
    adapter = sorted(state["adapter"]) if "adapter" in state else None
    return state, (meta, state["rng"], adapter, str(path))
