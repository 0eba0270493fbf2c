"""The one training loop's seams (trainer/loop.py) on the tiny random Llama and a real SQLite queue:
sync production in line before each take, fully_async producers under back-pressure and cancelled at
the end, weight-sync / report / eval hooks in order, the job's state in every checkpoint, leases held
between checkpoints (renewed, acked after the checkpoint that holds them), and a run directory of the
old job (`trained_ids`) resuming."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

from miles_env.errors import ConfigError
from miles_env.queue.sqlite import SqliteReplayQueue
from miles_env.trainer.build import build_trainer
from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.loop import LoopConfig, StepHooks, StepResult, TrainLoop
from miles_env.trainer.torch_backend import TorchTrainer
from miles_env.types import Trajectory
from tests.trainer_support import episode


class Recorder(StepHooks):
    """Produces groups into the queue and records every hook call."""

    def __init__(self, queue: SqliteReplayQueue, trajs: tuple[Trajectory, Trajectory]) -> None:
        self.queue, self.trajs = queue, trajs
        self.calls: list[tuple[str, int]] = []
        self.cursor = itertools.count()
        self.restored: Mapping[str, Any] | None = None
        self.leased_at_report: list[int] = []
        self.metrics: list[dict[str, float]] = []

    async def produce(self, n_groups: int) -> None:
        self.calls.append(("produce", n_groups))
        for _ in range(n_groups):
            g = f"g{next(self.cursor)}"
            for i, score in enumerate((1.0, 0.0)):
                await self.queue.aio.put(episode(f"{g}-{i}", g, self.trajs[i], score))

    def checkpoint_state(self) -> dict[str, Any]:
        return {"cursor": len([c for c in self.calls if c[0] == "produce"])}

    def restore(self, extra: Mapping[str, Any]) -> None:
        self.restored = extra

    async def after_step(self, step: int) -> dict[str, float]:
        self.calls.append(("after_step", step))
        return {"sync_s": 0.5}

    async def report(self, result: StepResult) -> None:
        self.calls.append(("report", result.step))
        assert result.metrics["sync_s"] == 0.5 and result.metrics["train_s"] > 0
        assert "rollout_wait_s" in result.metrics and result.metrics["episodes_per_min"] > 0
        self.metrics.append(result.metrics)
        self.leased_at_report.append(self.queue.stats().leased_groups)

    async def evaluate(self, step: int) -> None:
        self.calls.append(("evaluate", step))


def test_sync_mode_produces_in_line_and_holds_leases_until_the_checkpoint(
    tiny: Path, trajs: tuple[Trajectory, Trajectory], tmp_path: Path
) -> None:
    q = SqliteReplayQueue(tmp_path / "queue.db", group_size=2, max_pending_groups=4)
    hooks = Recorder(q, trajs)
    cfg = LoopConfig(steps=3, groups_per_step=2, ckpt_dir=tmp_path / "ckpt", ckpt_every=2, eval_every=1)
    trainer = TorchTrainer(tiny, TrainerConfig(lr=1e-3))
    assert anyio.run(TrainLoop(q.aio, trainer, cfg, hooks).run) == 3
    per_step = [("produce", 2), ("after_step", 1), ("report", 1), ("evaluate", 1)]
    assert hooks.calls[:4] == per_step
    assert hooks.calls[4:8] == [("produce", 2), ("after_step", 2), ("report", 2), ("evaluate", 2)]
    assert hooks.calls[8:] == [("produce", 2), ("after_step", 3), ("report", 3)]  # no eval at the last step
    # step 1's two groups stay leased until step 2's checkpoint; step 3 checkpoints as the last step
    assert hooks.leased_at_report == [2, 0, 0]
    assert all("rollout_s" in m for m in hooks.metrics)  # the time spent producing in line
    assert ["checkpoint_s" in m for m in hooks.metrics] == [False, True, True]
    assert [p.name for p in sorted((tmp_path / "ckpt").iterdir())] == ["step_00000002", "step_00000003"]
    two = json.loads((tmp_path / "ckpt/step_00000002/trainer.json").read_text())["extra"]
    assert two["trained_episode_ids"] == ["g0-0", "g0-1", "g1-0", "g1-1", "g2-0", "g2-1", "g3-0", "g3-1"]
    assert two["cursor"] == 2 and len(two["lease_ids"]) == 4
    s = q.stats()
    assert s.acked_groups == 6 and s.leased_groups == 0 and s.pending_groups == 0


class StaleOnce(Recorder):
    """A job-like producer (`produces`): its groups carry the engine's version; at step 3 one group
    comes from weights too old to train (dropped as stale by the take)."""

    produces = True

    def __init__(self, queue: SqliteReplayQueue, trajs: tuple[Trajectory, Trajectory]) -> None:
        super().__init__(queue, trajs)
        self.version, self.stale_left = 0, 1

    async def produce(self, n_groups: int) -> None:
        self.calls.append(("produce", n_groups))
        for _ in range(n_groups):
            g, v = f"g{next(self.cursor)}", self.version
            if self.stale_left and self.version >= 2:
                v, self.stale_left = 0, 0
            for i, score in enumerate((1.0, 0.0)):
                turns = [t.model_copy(update={"weight_version": v}) for t in self.trajs[i].turns]
                traj = self.trajs[i].model_copy(update={"turns": turns})
                await self.queue.aio.put(episode(f"{g}-{i}", g, traj, score))

    async def after_step(self, step: int) -> dict[str, float]:
        self.version = step
        return await super().after_step(step)


def test_sync_mode_rolls_out_again_what_a_take_came_short_of(
    tiny: Path, trajs: tuple[Trajectory, Trajectory], tmp_path: Path
) -> None:
    """A group dropped as stale does not leave a sync step waiting forever for a group nobody is
    rolling out: the loop asks the producer for the missing one (it hung before)."""
    q = SqliteReplayQueue(tmp_path / "queue.db", group_size=2, max_pending_groups=4)
    hooks = StaleOnce(q, trajs)
    cfg = LoopConfig(steps=3, groups_per_step=2, ckpt_dir=tmp_path / "ckpt", max_staleness=0)
    trainer = TorchTrainer(tiny, TrainerConfig(lr=1e-3))

    async def main() -> int:
        with anyio.fail_after(120):
            return await TrainLoop(q.aio, trainer, cfg, hooks).run()

    assert anyio.run(main) == 3
    produced = [c for c in hooks.calls if c[0] == "produce"]
    assert produced == [("produce", 2), ("produce", 2), ("produce", 2), ("produce", 1)]
    assert [m.get("groups_reproduced") for m in hooks.metrics] == [None, None, 1.0]
    s = q.stats()
    assert s.stale_groups == 1 and s.acked_groups == 6 and s.pending_groups == 0


def test_fully_async_producers_run_alongside_and_stop_with_the_loop(
    tiny: Path, trajs: tuple[Trajectory, Trajectory], tmp_path: Path
) -> None:
    q = SqliteReplayQueue(tmp_path / "queue.db", group_size=2, max_pending_groups=3)
    hooks = Recorder(q, trajs)
    cfg = LoopConfig(steps=2, groups_per_step=2, ckpt_dir=tmp_path / "ckpt", producers=2, poll_s=0.01)
    trainer = TorchTrainer(tiny, TrainerConfig(lr=1e-3))
    assert anyio.run(TrainLoop(q.aio, trainer, cfg, hooks).run) == 2
    produced = [c for c in hooks.calls if c[0] == "produce"]
    assert produced and all(n == 1 for _, n in produced)  # one group per call, never in line
    assert not any("rollout_s" in m for m in hooks.metrics)
    s = q.stats()
    assert s.acked_groups == 4 and s.leased_groups == 0
    # back-pressure: a producer waits while max_pending_groups (3) are pending; the check comes
    # before its group is rolled out, so two producers that both saw room may overshoot by one
    assert s.pending_groups <= 3 + (cfg.producers - 1)


def test_resume_restores_the_job_state_and_reads_the_old_key(
    tiny: Path, trajs: tuple[Trajectory, Trajectory], tmp_path: Path
) -> None:
    q = SqliteReplayQueue(tmp_path / "queue.db", group_size=2)
    for g in ("a", "b", "c"):
        for i, score in enumerate((1.0, 0.0)):
            q.put(episode(f"{g}-{i}", g, trajs[i], score), block=False)
    trained = q.take(2, lease_s=3600)  # "a" and "b": trained by a run that died after its checkpoint
    q.take(1, lease_s=3600)  # "c": leased when it died, never trained
    old = TorchTrainer(tiny, TrainerConfig(lr=1e-3))
    old.train_step([list(lease.episodes) for lease in trained])
    ids = [eid for lease in trained for eid in lease.episode_ids]
    old.save_checkpoint(tmp_path / "ckpt", {"step": 1, "trained_ids": ids, "rng": [3, [1, 2], None]})

    hooks = Recorder(q, trajs)
    cfg = LoopConfig(steps=1, groups_per_step=1, ckpt_dir=tmp_path / "ckpt")
    loop = TrainLoop(q.aio, TorchTrainer(tiny), cfg, hooks)
    resumed = anyio.run(loop.resume)
    assert resumed is not None and (resumed.step, resumed.acked, resumed.released) == (1, 2, 1)
    assert hooks.restored is not None and hooks.restored["rng"] == [3, [1, 2], None]
    s = q.stats()
    assert s.acked_groups == 2 and s.pending_groups == 1 and s.leased_groups == 0


def test_build_trainer_looks_backends_up_by_name(tiny: Path) -> None:
    trainer = build_trainer("torch", tiny, {"lr": 1e-3, "seed": 3})
    assert isinstance(trainer, TorchTrainer) and trainer.config.lr == 1e-3
    with pytest.raises(ConfigError, match=r"trainer backend 'jax' is unknown; known: megatron, torch"):
        build_trainer("jax", tiny, {})
    with pytest.raises(ConfigError, match=r"trainer\.lr: Input should be greater than 0"):
        build_trainer("torch", tiny, {"lr": -1.0})
    with pytest.raises(ConfigError, match=r"trainer\.lrr: Extra inputs are not permitted"):
        build_trainer("torch", tiny, {"lrr": 1.0})
