"""The one training loop: take -> train_step -> checkpoint -> ack, for `miles-env train` and any driver.

Invariant (exactly-once training across crashes): a group is acked only after a checkpoint
that contains its update is durable. Each checkpoint's extra holds `trained_episode_ids`, the
ids trained since the previous checkpoint (exactly the groups its acks cover). `resume()`
restores the newest checkpoint and calls `queue.recover(those ids)`: what the checkpoint learned
from is acked, every other lease goes back to pending (the restored model never saw it). Leases
held between checkpoints (checkpoint_every > 1) are renewed at every take (where expiry is
applied) and acked after the checkpoint that holds them. A checkpoint written before this key
(the job's cumulative `trained_ids`) still resumes.

Lifecycle of a step: [sync: hooks.produce(groups_per_step)] -> take groups_per_step fresh-enough
groups (staleness filter at hooks.current_version) -> train_step in a worker thread (rollouts on
the event loop keep going) -> checkpoint + ack every checkpoint_every steps and at the last one
-> hooks.after_step (weight sync; its metrics join the step's) -> hooks.report ->
hooks.evaluate every eval_every steps, the last excepted (the caller evaluates after the loop).
With `producers > 0` (fully_async) that many tasks call hooks.produce(1) for the whole run,
throttled by the queue's back-pressure (checked before each group is rolled out, so n producers
may overshoot max_pending_groups by n - 1), and are cancelled when the loop ends. A non-None
`hooks.stop_reason()` (the job's cost budget) ends it early instead: no new step starts,
producers finish the group in flight (the queue keeps it), a step waiting for groups trains what
there is, and what was trained is checkpointed and acked.

Staleness is per episode (queue/contract.py): a lease's stale episodes never train; with
`stale_in_baseline` their rewards still count in their fresh siblings' baseline (a TrainGroup,
trainer/groups.py). Off by default: the baseline estimates the current policy's reward on the
task, and a stale sibling's is an older policy's (a bias that grows with the staleness); it also
keeps a group's advantages exactly those of its trained members, the rule infrastructure
failures follow. `stale_episodes` in the step's metrics counts them.

Sync mode never waits for a group nobody is rolling out: when `hooks.produces`, the step's
groups are all in the queue once `produce` returns, so a take that comes short (a group dropped as
stale or quarantined, a cluster task given up after its attempts) rolls the missing groups out
again (`groups_reproduced` in the step's metrics) instead of waiting forever.

Dynamic sampling (`dynamic_sampling`, DAPO's; verl's `filter_groups`, slime's
`--dynamic-sampling-filter-path`): the drain judges every group it takes with
`trainer.groups.has_signal` (on what would train: its fresh, policy-ended members and their
baseline) and trains only those with signal; a group whose rewards are all equal is filtered:
never trained, held and acked with the step's checkpoint like a trained one (its ids are the
checkpoint's `filtered_episode_ids`: consumed, so a restart acks it and never draws it again).
The drain keeps taking (sync: rolling more groups out) until the step has `groups_per_step`
groups with signal or it has drawn `ceil(max_sampling_factor * groups_per_step)` groups; then it
trains what it has, and with none the step is skipped: `train_step(())` takes no optimizer
update but counts, so the run always ends (the step's `dynamic_sampling_skipped` is 1). At the drain, not at the producer, so
every mode (sync, fully_async, cluster workers) filters the same way with one rule. Metrics:
`groups_drawn`, `groups_filtered`; the filtered groups are in `StepResult.filtered`.

`StepHooks` is the job's seam and does nothing by default, so draining a filled queue is
`await TrainLoop(queue, trainer, LoopConfig(...)).run()`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import anyio
import anyio.to_thread

from miles_env.queue.aio import AsyncReplayQueue
from miles_env.queue.contract import Lease
from miles_env.trainer.groups import TrainGroup, has_signal
from miles_env.types import POLICY_ENDS, Episode, EpisodeEnd

if TYPE_CHECKING:
    import torch

__all__ = [
    "TrainerBackend",
    "LoopConfig",
    "StepHooks",
    "StepResult",
    "Resumed",
    "TrainLoop",
    "train_from_queue",
]

TRAINED_IDS = "trained_episode_ids"  # the checkpoint key; `trained_ids` is its older (cumulative) name
FILTERED_IDS = "filtered_episode_ids"  # dynamic sampling's groups consumed without training


class TrainerBackend(Protocol):
    """What the loop and the job ask of a trainer (TorchTrainer, MegatronTrainer, ranks.Leader).
    `step` is the number of optimizer steps taken, which is also the weight version."""

    step: int

    def train_step(self, groups: Sequence[Sequence[Episode]]) -> dict[str, float]: ...

    def save_checkpoint(self, ckpt_dir: str | Path, extra: dict[str, Any] | None = None) -> Path: ...

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict[str, Any] | None: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def export_weights(self, path: str | Path) -> Path: ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...


@dataclass(frozen=True, slots=True)
class LoopConfig:
    steps: int  # train until trainer.step == steps
    groups_per_step: int
    ckpt_dir: Path
    ckpt_every: int = 1
    max_staleness: int | None = None  # None: no staleness filter
    stale_in_baseline: bool = False  # a stale episode's reward counts in its siblings' baseline
    producers: int = 0  # 0: hooks.produce(groups_per_step) before each step (sync); n: n concurrent producers
    eval_every: int = 0  # 0: never inside the loop
    lease_s: float = 3600.0  # renewed every step; a restart recovers leases, not this timer
    poll_s: float = 0.05  # while waiting for complete groups
    dynamic_sampling: bool = False  # train only groups with signal (module docstring)
    max_sampling_factor: float = 3.0  # dynamic sampling draws at most ceil(this x groups_per_step) a step
    policy_ends: tuple[EpisodeEnd, ...] = tuple(sorted(POLICY_ENDS))  # members that train (has_signal)

    @property
    def draw_budget(self) -> int | None:
        """Groups one step may draw (dynamic sampling); None: no filter, exactly groups_per_step."""
        if not self.dynamic_sampling:
            return None
        return max(self.groups_per_step, math.ceil(self.max_sampling_factor * self.groups_per_step))


@dataclass(frozen=True, slots=True)
class StepResult:
    step: int
    groups: tuple[tuple[Episode, ...], ...]
    metrics: dict[str, float]  # train_step's, the loop's timings (train_s, checkpoint_s, ...), after_step's
    filtered: tuple[tuple[Episode, ...], ...] = ()  # dynamic sampling: drawn, no signal, never trained


@dataclass(frozen=True, slots=True)
class Resumed:
    step: int  # the restored checkpoint's step
    acked: int  # groups the checkpoint trained on, acked now
    released: int  # leases returned to pending


class StepHooks:
    """The job's seams into the loop; every default does nothing. Subclass and override."""

    # True when `produce` rolls the groups out (the job); False when someone else fills the queue.
    # In sync mode a producing loop rolls out again what a take came short of (module docstring).
    produces: ClassVar[bool] = False

    async def produce(self, n_groups: int) -> None:
        """Roll out `n_groups` groups into the queue (default: someone else fills it)."""

    def current_version(self, step: int) -> int:
        """The weight version the engine serves while the trainer is at `step` (staleness filter)."""
        return step

    def checkpoint_state(self) -> dict[str, Any]:
        """JSON-able state saved in every checkpoint's extra (the job's rng, its task cursor)."""
        return {}

    def restore(self, extra: Mapping[str, Any]) -> None:
        """Take back `checkpoint_state()` from the extra of the checkpoint resumed from."""

    async def after_step(self, step: int) -> dict[str, float]:
        """Right after the step (and its checkpoint): weight sync. Returns metrics for the step."""
        return {}

    async def report(self, result: StepResult) -> None:
        """Log the finished step."""

    async def evaluate(self, step: int) -> None:
        """Every `eval_every` steps."""

    def stop_reason(self) -> str | None:
        """Not None: start no more steps (the job's cost budget). Producers finish the group they
        are rolling out (the queue keeps it), a step waiting for groups trains what there is."""
        return None


class _Stopped(Exception):
    """The run stopped (StepHooks.stop_reason) while a step waited for groups and none came."""


class TrainLoop:
    def __init__(
        self,
        queue: AsyncReplayQueue,
        trainer: TrainerBackend,
        config: LoopConfig,
        hooks: StepHooks | None = None,
    ) -> None:
        self.queue, self.trainer, self.config = queue, trainer, config
        self.hooks = hooks or StepHooks()
        self.held: list[Lease] = []  # trained, not yet in a checkpoint
        self.held_filtered: list[Lease] = []  # dynamic sampling: drawn, not trained, not yet acked
        self.resumed: Resumed | None = None
        self.stopped: str | None = None  # why the run ended before `steps` (StepHooks.stop_reason)
        self._started = False
        self._producing = 0  # producers inside hooks.produce now
        self._reproduced = 0  # sync: groups rolled out again this step, for a take that came short

    async def resume(self) -> Resumed | None:
        """Restore the newest checkpoint (if any) and settle the queue with it; idempotent."""
        if self._started:
            return self.resumed
        self._started = True
        extra = await anyio.to_thread.run_sync(self.trainer.load_checkpoint, self.config.ckpt_dir)
        ids: list[str] = [] if extra is None else list(extra.get(TRAINED_IDS, extra.get("trained_ids", [])))
        ids += [] if extra is None else extra.get(FILTERED_IDS, [])  # consumed: acked, never drawn again
        acked, released = await self.queue.recover(ids)  # also frees leases of a run that never checkpointed
        if extra is None:
            return None
        self.hooks.restore(extra)
        self.resumed = Resumed(self.trainer.step, acked, released)
        return self.resumed

    async def run(self) -> int:
        """Train until `trainer.step == steps` (resuming first); return the final step."""
        await self.resume()
        cfg = self.config
        async with anyio.create_task_group() as tg:
            for _ in range(cfg.producers):
                tg.start_soon(self._produce_forever)
            while self.trainer.step < cfg.steps:
                self.stopped = self.hooks.stop_reason()
                if self.stopped is not None:
                    break  # producers end their group in flight; the task group waits for them
                try:
                    result = await self.step()
                except _Stopped:
                    self.stopped = self.hooks.stop_reason()
                    break
                await self.hooks.report(result)
                if cfg.eval_every and result.step % cfg.eval_every == 0 and result.step < cfg.steps:
                    await self.hooks.evaluate(result.step)
            if self.stopped is None:
                tg.cancel_scope.cancel()
        if self.held or self.held_filtered:  # stopped between checkpoints: made durable, acked
            await self._checkpoint()
        return self.trainer.step

    async def _produce_forever(self) -> None:
        while self.hooks.stop_reason() is None:  # back-pressure: queue.put waits while too many
            self._producing += 1  # complete groups are pending
            try:
                await self.hooks.produce(1)
            finally:
                self._producing -= 1

    async def step(self) -> StepResult:
        cfg = self.config
        metrics: dict[str, float] = {}
        t0 = time.perf_counter()
        if cfg.producers == 0:
            await self.hooks.produce(cfg.groups_per_step)
            metrics["rollout_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        leases, filtered = await self._collect(cfg.groups_per_step)
        if not leases and not filtered:
            raise _Stopped
        metrics["rollout_wait_s"] = time.perf_counter() - t1
        if self._reproduced:
            metrics["groups_reproduced"], self._reproduced = float(self._reproduced), 0
        groups = tuple(self._group(lease) for lease in leases)
        if cfg.dynamic_sampling:
            metrics["groups_drawn"] = float(len(leases) + len(filtered))
            metrics["groups_filtered"] = float(len(filtered))
            metrics["dynamic_sampling_skipped"] = float(not leases)  # train_step(()): no update
        if stale := sum(len(lease.stale) for lease in leases):
            metrics["stale_episodes"] = float(stale)
        t2 = time.perf_counter()
        metrics.update(await anyio.to_thread.run_sync(self.trainer.train_step, groups))
        metrics["train_s"] = time.perf_counter() - t2
        self.held.extend(leases)
        self.held_filtered.extend(filtered)
        if self.trainer.step % cfg.ckpt_every == 0 or self.trainer.step >= cfg.steps:
            metrics["checkpoint_s"] = await self._checkpoint()
        metrics.update(await self.hooks.after_step(self.trainer.step))
        n_episodes = sum(len(g) for g in groups)
        metrics["episodes_per_min"] = n_episodes / max(1e-9, (time.perf_counter() - t0) / 60)
        return StepResult(self.trainer.step, groups, metrics, tuple(self._group(f) for f in filtered))

    def _group(self, lease: Lease) -> tuple[Episode, ...]:
        """What a lease trains: its fresh episodes, and with stale_in_baseline its stale ones as
        baseline only (module docstring)."""
        if self.config.stale_in_baseline and lease.stale:
            return TrainGroup(lease.episodes, baseline=lease.stale)
        return lease.episodes

    async def _checkpoint(self) -> float:
        """Save the state that trained `held`, then ack `held` (only once that is durable)."""
        t0 = time.perf_counter()
        extra = {
            **self.hooks.checkpoint_state(),
            TRAINED_IDS: [eid for lease in self.held for eid in lease.episode_ids],
            FILTERED_IDS: [eid for lease in self.held_filtered for eid in lease.episode_ids],
            "lease_ids": [lease.lease_id for lease in [*self.held, *self.held_filtered]],
        }
        await anyio.to_thread.run_sync(self.trainer.save_checkpoint, self.config.ckpt_dir, extra)
        await self.queue.ack([*self.held, *self.held_filtered])
        self.held, self.held_filtered = [], []
        return time.perf_counter() - t0

    async def _collect(self, n: int) -> tuple[list[Lease], list[Lease]]:
        """Lease `n` complete, fresh-enough groups, waiting for them; with dynamic sampling, `n` with
        signal, drawing at most `draw_budget` (module docstring). Returns (to train, filtered).
        The held leases (and those taken so far) are renewed before every take, where expiry is
        applied, so a long production, eval or wait never lets a trained, unacked group expire."""
        cfg = self.config
        version = self.hooks.current_version(self.trainer.step)
        budget = cfg.draw_budget
        leases: list[Lease] = []
        filtered: list[Lease] = []

        def remaining() -> int:  # groups still to take: those missing, within the draw budget
            missing = n - len(leases)
            return missing if budget is None else min(missing, budget - len(leases) - len(filtered))

        while True:
            if held := [*self.held, *self.held_filtered, *leases, *filtered]:
                await self.queue.renew(held, cfg.lease_s)
            want = remaining()
            taken = await self.queue.take(
                want, current_version=version, max_staleness=cfg.max_staleness, lease_s=cfg.lease_s
            )
            for lease in taken:
                worth = budget is None or has_signal(self._group(lease), cfg.policy_ends)
                (leases if worth else filtered).append(lease)
            if len(leases) >= n or (budget is not None and len(leases) + len(filtered) >= budget):
                return leases, filtered
            if self._producing == 0 and self.hooks.stop_reason() is not None:
                return leases, filtered  # stopping, and no group is coming: train what there is
            if cfg.producers == 0 and self.hooks.produces:  # sync: nothing else is coming (docstring)
                self._reproduced += want - len(taken)  # a take that came short (filtered ones: drawn)
                await self.hooks.produce(remaining())
                continue
            await anyio.sleep(cfg.poll_s)


async def train_from_queue(
    queue: AsyncReplayQueue, trainer: TrainerBackend, config: LoopConfig, hooks: StepHooks | None = None
) -> int:
    """Resume from `config.ckpt_dir` and train until `trainer.step == config.steps`; the final step."""
    return await TrainLoop(queue, trainer, config, hooks).run()
