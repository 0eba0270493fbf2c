"""How the main job moves the trainer's weights to the engine after each step.

The engine's weight version becomes the trainer's step. Four ways, chosen by the run config and
the engine's capabilities: the LoRA adapter alone (`trainer.lora`), a delta of what changed
(`weight_sync: delta | delta_disk`, `trainer/weight_sync.py`), the whole state in process (an
engine that is `InProcessWeights`), or an HF folder on disk that the engine loads (every remote
engine). Each returns `sync_s` and `sync_bytes`, and with several servers each one's too.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal

import anyio
import anyio.to_thread

from miles_env.config import RunConfig
from miles_env.engines.base import Engine, InProcessWeights, PerServerSync
from miles_env.trainer.loop import TrainerBackend

if TYPE_CHECKING:
    from miles_env.trainer.weight_sync import WeightSyncer

__all__ = ["build_syncer", "sync_weights"]


def _nbytes(trainer: TrainerBackend) -> int:
    seen: set[int] = set()
    total = 0
    for _, p in trainer.named_parameters():
        key = p.data_ptr() or id(p)  # an FSDP2 shard (DTensor) has data_ptr 0; its numel is global
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


def build_syncer(cfg: RunConfig, engine: Engine) -> WeightSyncer | None:
    """The delta syncer (weight_sync: delta | delta_disk), in the dtype of an in-process engine."""
    if not cfg.weight_sync.startswith("delta"):
        return None
    import torch

    from miles_env.trainer.weight_sync import WeightSyncer

    dtype = next(engine.model.parameters()).dtype if isinstance(engine, InProcessWeights) else torch.float32
    transport: Literal["in_process", "disk"] = "disk" if cfg.weight_sync == "delta_disk" else "in_process"
    return WeightSyncer(mode="delta", transport=transport, dtype=dtype, workdir=cfg.run_dir / "weights")


def _per_server(engine: Engine, metrics: dict[str, float]) -> dict[str, float]:
    """An engine over several servers (PerServerSync) adds `sync_engines` and, for server i (its
    order in the engine's live URLs), `sync_s_engine{i}` (its load, timed by the engine) and
    `sync_bytes_engine{i}` (what it read: every server loads the whole update)."""
    if not isinstance(engine, PerServerSync) or not engine.last_sync():
        return metrics
    parts = engine.last_sync()
    out = {**metrics, "sync_engines": float(len(parts))}
    for i, part in enumerate(parts):
        out[f"sync_s_engine{i}"] = part.seconds
        out[f"sync_bytes_engine{i}"] = metrics["sync_bytes"]
    return out


async def sync_weights(
    cfg: RunConfig, trainer: TrainerBackend, engine: Engine, syncer: WeightSyncer | None, step: int
) -> dict[str, float]:
    """Engine version := trainer step. Returns sync_s, sync_bytes (moved) and, for delta, more;
    with several servers, each one's too (`_per_server`). With trainer.lora, the adapter only."""
    from miles_env.trainer.lora import AdapterTrainer, sync_adapter

    if isinstance(trainer, AdapterTrainer) and trainer.lora is not None:
        return await sync_adapter(trainer, engine, step, cfg.run_dir / "weights")
    if syncer is not None:
        state = await anyio.to_thread.run_sync(trainer.state_dict)
        return _per_server(engine, dict(await syncer.sync(engine, state, step)))
    t0 = time.perf_counter()
    # A remote engine (vllm, sglang) is not InProcessWeights: it always syncs through disk.
    if cfg.weight_sync == "in_process" and isinstance(engine, InProcessWeights):
        state = await anyio.to_thread.run_sync(trainer.state_dict)
        await engine.update_weights(state, weight_version=step)
    else:
        path = await anyio.to_thread.run_sync(trainer.export_weights, cfg.run_dir / "weights")
        await engine.update_weights_from_disk(path, weight_version=step)
    return _per_server(engine, {"sync_s": time.perf_counter() - t0, "sync_bytes": float(_nbytes(trainer))})
