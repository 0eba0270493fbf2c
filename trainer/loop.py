"""Drain the replay queue into the trainer: take -> train_step -> checkpoint -> ack.

Invariant (exactly-once training across crashes): a group is acked only after a
checkpoint that contains its update is durable, and every checkpoint records the
episode ids trained since the previous one. On start the loop restores the
newest checkpoint and calls `queue.recover(those ids)`: groups the checkpoint
already learned from are acked, every other lease goes back to pending (the
restored model never saw them, so they must be trained again). Groups trained
between checkpoints (ckpt_every > 1) keep their leases, renewed each step.

The trainer step runs in a worker thread so rollouts on the same event loop
keep going. Weight sync to the engine is the caller's business: `on_step`
(sync or async) receives (step, metrics) after each step.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.to_thread

from miles_env.queue import AsyncReplayQueue, Lease, SqliteReplayQueue
from miles_env.types import Episode

__all__ = ["train_from_queue", "TrainerBackend"]

OnStep = Callable[[int, dict[str, float]], Awaitable[None] | None]


class TrainerBackend(Protocol):
    step: int

    def train_step(self, groups: list[list[Episode]]) -> dict[str, float]: ...

    def save_checkpoint(self, ckpt_dir: str | Path, extra: dict[str, Any] | None = None) -> Path: ...

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict[str, Any] | None: ...


async def _collect(
    queue: AsyncReplayQueue, n: int, version: int, max_staleness: int | None, lease_s: float, poll_s: float
) -> list[Lease]:
    leases: list[Lease] = []
    while len(leases) < n:
        got = await queue.take(
            n - len(leases), current_version=version, max_staleness=max_staleness, lease_s=lease_s
        )
        leases.extend(got)
        if len(leases) < n:
            if leases:
                await queue.renew(leases, lease_s)
            await anyio.sleep(poll_s)
    return leases


async def train_from_queue(
    queue: SqliteReplayQueue | AsyncReplayQueue,
    trainer: TrainerBackend,
    *,
    steps: int,
    groups_per_step: int,
    ckpt_dir: str | Path,
    ckpt_every: int = 1,
    on_step: OnStep | None = None,
    max_staleness: int | None = None,
    current_version: Callable[[], int] | None = None,
    lease_s: float = 3600.0,
    poll_s: float = 0.05,
) -> int:
    """Train until `trainer.step == steps` (resuming from ckpt_dir); return the final step.
    `current_version` gives the weight version for the staleness filter (default: trainer.step)."""
    q = queue.aio if isinstance(queue, SqliteReplayQueue) else queue
    version = current_version or (lambda: trainer.step)
    extra = await anyio.to_thread.run_sync(trainer.load_checkpoint, ckpt_dir)
    await q.recover((extra or {}).get("trained_episode_ids", []))
    held: list[Lease] = []
    while trainer.step < steps:
        leases = await _collect(q, groups_per_step, version(), max_staleness, lease_s, poll_s)
        groups = [list(lease.episodes) for lease in leases]
        metrics = await anyio.to_thread.run_sync(trainer.train_step, groups)
        held.extend(leases)
        if trainer.step % ckpt_every == 0 or trainer.step >= steps:
            ids = [eid for lease in held for eid in lease.episode_ids]
            await anyio.to_thread.run_sync(
                trainer.save_checkpoint,
                ckpt_dir,
                {"trained_episode_ids": ids, "lease_ids": [x.lease_id for x in held]},
            )
            await q.ack(held)
            held = []
        else:
            await q.renew(held, lease_s)
        if on_step is not None:
            result = on_step(trainer.step, metrics)
            if inspect.isawaitable(result):
                await result
    return trainer.step
