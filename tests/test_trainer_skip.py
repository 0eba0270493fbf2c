"""Zero-advantage groups carry no gradient: by default they are not even forwarded."""

from __future__ import annotations

from miles_env.trainer.config import TrainerConfig
from miles_env.trainer.torch_backend import flatten_groups
from miles_env.types import Episode, Reward, Status, Trajectory


def _ep(eid: str, group: str, score: float) -> Episode:
    traj = Trajectory(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -0.5, -0.25])
    return Episode(
        id=eid, task_id=group, env="toy", group_id=group, status=Status.COMPLETED,
        reward=Reward(score=score), samples=[traj],
    )  # fmt: skip


def test_uniform_groups_are_skipped_and_mixed_groups_kept() -> None:
    uniform = [_ep("a", "g1", 0.0), _ep("b", "g1", 0.0)]
    mixed = [_ep("c", "g2", 1.0), _ep("d", "g2", 0.0)]
    kept = flatten_groups([uniform, mixed], TrainerConfig())
    assert [s.reward for s in kept] == [1.0, 0.0]
    assert kept[0].advantage > 0 > kept[1].advantage
    everything = flatten_groups([uniform, mixed], TrainerConfig(skip_zero_advantage=False))
    assert len(everything) == 4 and [s.advantage for s in everything[:2]] == [0.0, 0.0]
