"""Dynamic sampling (`rollout.dynamic_sampling`, trainer/loop.py; DAPO's, verl's `filter_groups`).

Unit: `has_signal` says a group trains something exactly when `flatten_groups` gives it a sample
(infrastructure failures left out, a TrainGroup's baseline counted, the mean's rounding absorbed).
Loop, on the tiny random Llama and a real SQLite queue: in sync mode a step trains only groups
with signal and rolls more out until it has groups_per_step of them; the filtered ones are counted,
never trained, and acked with the step's checkpoint; when the draw budget is spent the step trains
what it has, or with none takes no update and still counts (the run ends); fully_async producers
are filtered at the same drain. Config: the keys, their one-line errors, and the job's LoopConfig.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from miles_env.config import RunConfig, validate_config
from miles_env.errors import ConfigError
from miles_env.job.plan import loop_config
from miles_env.queue.sqlite import SqliteReplayQueue
from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.groups import TrainGroup, has_signal
from miles_env.trainer.loop import LoopConfig, StepHooks, StepResult, TrainLoop
from miles_env.trainer.samples import flatten_groups
from miles_env.trainer.torch_backend import TorchTrainer
from miles_env.types import POLICY_ENDS, Episode, EpisodeEnd, Status, Trajectory
from tests.trainer_support import episode

POLICY = tuple(sorted(POLICY_ENDS))


def _group(trajs: tuple[Trajectory, Trajectory], name: str, scores: tuple[float, ...]) -> list[Episode]:
    return [episode(f"{name}-{i}", name, trajs[i % 2], s) for i, s in enumerate(scores)]


def test_has_signal_is_exactly_whether_the_group_trains_a_sample(
    trajs: tuple[Trajectory, Trajectory],
) -> None:
    failed = episode("f", "g", trajs[0], 0.0).model_copy(
        update={"status": Status.FAILED, "end": EpisodeEnd.SANDBOX_START}
    )
    cases: dict[str, tuple[list[Episode] | TrainGroup, bool]] = {
        "all pass": (_group(trajs, "a", (1.0, 1.0, 1.0)), False),
        "all fail": (_group(trajs, "b", (0.0, 0.0)), False),
        "mixed": (_group(trajs, "c", (1.0, 0.0, 0.0)), True),
        "partial credit": (_group(trajs, "d", (0.5, 0.25)), True),
        "rounding": (_group(trajs, "e", (0.1, 0.1, 0.1)), False),  # mean 0.10000000000000002
        # an infrastructure failure is no member: its 0 gives two passes no signal
        "failure left out": ([*_group(trajs, "f", (1.0, 1.0)), failed], False),
        "only failures": ([failed], False),
        # a stale sibling's reward in the baseline gives equal members an advantage
        "baseline": (TrainGroup(_group(trajs, "h", (1.0, 1.0)), baseline=_group(trajs, "s", (0.0,))), True),
        "empty": ([], False),
    }
    cfg = TrainerConfig()
    for name, (group, want) in cases.items():
        assert has_signal(group, POLICY) is want, name
        # the trainer's own judgement: a sample with a real advantage (rounding leaves +-1e-11)
        assert any(abs(x.advantage) > 1e-9 for x in flatten_groups([group], cfg)) is want, name


class Scripted(StepHooks):
    """A job-like producer (`produces`): each group's rewards come from `scores` in turn."""

    produces = True

    def __init__(self, queue: SqliteReplayQueue, trajs: Any, scores: Iterator[tuple[float, ...]]) -> None:
        self.queue, self.trajs, self.scores = queue, trajs, scores
        self.produced: list[int] = []
        self.results: list[StepResult] = []
        self.cursor = itertools.count()

    async def produce(self, n_groups: int) -> None:
        self.produced.append(n_groups)
        for _ in range(n_groups):
            name = f"g{next(self.cursor)}"
            for ep in _group(self.trajs, name, next(self.scores)):
                await self.queue.aio.put(ep)

    async def report(self, result: StepResult) -> None:
        self.results.append(result)


SIGNAL, FLAT = (1.0, 0.0), (0.0, 0.0)


def _run(tiny: Path, tmp_path: Path, hooks: StepHooks, cfg: LoopConfig, q: SqliteReplayQueue) -> TorchTrainer:
    trainer = TorchTrainer(tiny, TrainerConfig(lr=1e-3))

    async def main() -> int:
        with anyio.fail_after(120):  # never hangs
            return await TrainLoop(q.aio, trainer, cfg, hooks).run()

    assert anyio.run(main) == cfg.steps
    return trainer


def test_sync_steps_train_only_groups_with_signal_and_roll_more_out(
    tiny: Path, trajs: tuple[Trajectory, Trajectory], tmp_path: Path
) -> None:
    q = SqliteReplayQueue(tmp_path / "queue.db", group_size=2, max_pending_groups=8)
    # step 1: S F F -> 2 missing -> S F -> 1 missing -> S; step 2: S S
    script = iter([SIGNAL, FLAT, FLAT, SIGNAL, FLAT, SIGNAL, SIGNAL, SIGNAL, SIGNAL])
    hooks = Scripted(q, trajs, script)
    cfg = LoopConfig(steps=2, groups_per_step=3, ckpt_dir=tmp_path / "ckpt", dynamic_sampling=True,
                     max_sampling_factor=3.0)  # fmt: skip
    _run(tiny, tmp_path, hooks, cfg, q)
    assert hooks.produced == [3, 2, 1, 3]
    one, two = hooks.results
    assert [g[0].group_id for g in one.groups] == ["g0", "g3", "g5"]
    assert [g[0].group_id for g in one.filtered] == ["g1", "g2", "g4"]
    assert (one.metrics["groups_drawn"], one.metrics["groups_filtered"]) == (6.0, 3.0)
    assert one.metrics["dynamic_sampling_skipped"] == 0.0 and one.metrics["samples"] == 6.0
    assert two.metrics["groups_filtered"] == 0.0 and "groups_reproduced" not in one.metrics
    # the filtered groups are consumed with the step: acked after its checkpoint, never drawn again
    extra = json.loads((tmp_path / "ckpt/step_00000001/trainer.json").read_text())["extra"]
    assert {e.split("-")[0] for e in extra["trained_episode_ids"]} == {"g0", "g3", "g5"}
    assert {e.split("-")[0] for e in extra["filtered_episode_ids"]} == {"g1", "g2", "g4"}
    s = q.stats()
    assert s.acked_groups == 9 and s.pending_groups == 0 and s.leased_groups == 0


def test_a_spent_budget_trains_what_it_has_or_skips_the_step(
    tiny: Path, trajs: tuple[Trajectory, Trajectory], tmp_path: Path
) -> None:
    q = SqliteReplayQueue(tmp_path / "queue.db", group_size=2, max_pending_groups=8)
    # budget ceil(1.5 x 2) = 3 a step. step 1: F S F -> budget spent, trains 1; step 2: F F F -> skipped
    hooks = Scripted(q, trajs, iter([FLAT, SIGNAL, FLAT, FLAT, FLAT, FLAT]))
    cfg = LoopConfig(steps=2, groups_per_step=2, ckpt_dir=tmp_path / "ckpt", dynamic_sampling=True,
                     max_sampling_factor=1.5)  # fmt: skip
    assert cfg.draw_budget == 3
    trainer = TorchTrainer(tiny, TrainerConfig(lr=1e-3))
    before: dict[str, torch.Tensor] = {}

    class Snapshot(Scripted):
        async def report(self, result: StepResult) -> None:
            await super().report(result)
            if result.step == 1:
                before.update({k: v.clone() for k, v in trainer.state_dict().items()})

    hooks = Snapshot(q, trajs, hooks.scores)

    async def main() -> int:
        with anyio.fail_after(120):
            return await TrainLoop(q.aio, trainer, cfg, hooks).run()

    assert anyio.run(main) == 2  # the skipped step counts: the run ends
    assert hooks.produced == [2, 1, 2, 1]
    one, two = hooks.results
    assert len(one.groups) == 1 and len(one.filtered) == 2 and one.metrics["dynamic_sampling_skipped"] == 0.0
    assert two.groups == () and len(two.filtered) == 3 and two.metrics["dynamic_sampling_skipped"] == 1.0
    assert two.metrics["samples"] == 0.0 and two.metrics["grad_norm"] == 0.0
    after = trainer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no update on the skipped step
    assert q.stats().acked_groups == 6


def test_fully_async_groups_are_filtered_at_the_drain(
    tiny: Path, trajs: tuple[Trajectory, Trajectory], tmp_path: Path
) -> None:
    q = SqliteReplayQueue(tmp_path / "queue.db", group_size=2, max_pending_groups=4)
    hooks = Scripted(q, trajs, itertools.cycle([FLAT, SIGNAL]))
    cfg = LoopConfig(steps=2, groups_per_step=2, ckpt_dir=tmp_path / "ckpt", producers=1, poll_s=0.01,
                     dynamic_sampling=True)  # fmt: skip
    _run(tiny, tmp_path, hooks, cfg, q)
    assert set(hooks.produced) == {1}
    for r in hooks.results:
        assert len(r.groups) == 2 and all(has_signal(g, POLICY) for g in r.groups)
        assert r.metrics["groups_filtered"] == len(r.filtered) and not any(
            has_signal(g, POLICY) for g in r.filtered
        )


def test_a_restart_acks_the_filtered_groups_of_its_checkpoint(
    tiny: Path, trajs: tuple[Trajectory, Trajectory], tmp_path: Path
) -> None:
    q = SqliteReplayQueue(tmp_path / "queue.db", group_size=2)
    for name, scores in (("a", SIGNAL), ("b", FLAT), ("c", SIGNAL)):
        for ep in _group(trajs, name, scores):
            q.put(ep, block=False)
    (trained,), (filtered,) = q.take(1, lease_s=3600), q.take(1, lease_s=3600)  # then the run died
    old = TorchTrainer(tiny, TrainerConfig(lr=1e-3))
    old.train_step([list(trained.episodes)])
    extra = {"trained_episode_ids": trained.episode_ids, "filtered_episode_ids": filtered.episode_ids}
    old.save_checkpoint(tmp_path / "ckpt", extra)
    cfg = LoopConfig(steps=2, groups_per_step=1, ckpt_dir=tmp_path / "ckpt", dynamic_sampling=True)
    resumed = anyio.run(TrainLoop(q.aio, TorchTrainer(tiny), cfg).resume)
    assert resumed is not None and (resumed.acked, resumed.released) == (2, 0)
    s = q.stats()
    assert s.acked_groups == 2 and s.pending_groups == 1  # "c" only: "b" is never drawn again


def test_the_job_counts_rollouts_per_trained_group(
    trajs: tuple[Trajectory, Trajectory], tmp_path: Path
) -> None:
    """signal.py's `rollouts_per_trained_group`: every episode rolled out since the last report
    (filtered groups', re-rolled ones') over the groups the step trained."""
    from miles_env.job.signal import SignalLedger
    from miles_env.rollout import GroupRun

    ledger = SignalLedger(POLICY, tmp_path / "failed.jsonl")
    trained, flat = _group(trajs, "a", (1.0, 0.0)), _group(trajs, "b", (0.0, 0.0))
    for g in (trained, flat):
        ledger.record(GroupRun(g, [], 0, False), step=0)
    assert ledger.step_metrics([trained])["rollouts_per_trained_group"] == 4.0
    assert ledger.step_metrics([])["rollouts_per_trained_group"] == 0.0  # counts start again


def test_the_config_keys_and_their_errors() -> None:
    base: dict[str, Any] = {"env": "terminal-basics"}
    cfg = RunConfig.model_validate({**base, "rollout": {"dynamic_sampling": True, "max_sampling_factor": 2}})
    loop = loop_config(cfg)
    assert loop.dynamic_sampling and loop.draw_budget == 2 * cfg.rollout.groups_per_step
    assert set(loop.policy_ends) == set(POLICY_ENDS)
    assert loop_config(RunConfig.model_validate(base)).draw_budget is None  # off by default
    with pytest.raises(ConfigError, match=r"rollout\.max_sampling_factor: Input should be greater than or"):
        validate_config({**base, "rollout": {"dynamic_sampling": True, "max_sampling_factor": 0.5}})
    with pytest.raises(
        ConfigError, match=r"rollout\.dynamic_sampling: rollout\.dynamic_sampling with algorithm=opd"
    ):
        opd = {"algorithm": "opd", "opd": {"teacher": {"kind": "hf", "model": "smollm2"}}}
        validate_config({**base, **opd, "rollout": {"dynamic_sampling": True}})
