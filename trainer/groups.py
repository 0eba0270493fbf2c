"""What of a leased group trains: its members that ended by the policy, and who sets their baseline.

Concept: a GRPO group's advantages are its members' rewards normalised over the group. Only
members whose end class (`Episode.end`) is a policy end (`TrainerConfig.policy_ends`) are
members for this purpose: an infrastructure failure (a sandbox that never started, a verifier
that crashed, a dead engine) says nothing about the policy, so it neither trains nor moves its
siblings' baseline; a policy end keeps its score (a timeout is an exit the policy learns to
avoid). A `TrainGroup` may also carry `baseline`: siblings whose rewards count in the baseline
(those of them that ended by the policy) but never train (stale episodes, under
`LoopConfig.stale_in_baseline`).

Invariant (tests/test_learning_signal.py): a group's advantages are, bit for bit, those of the
same group with its infrastructure failures removed. Pure and torch-free (the loop imports it).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from miles_env.types import Episode, EpisodeEnd

__all__ = ["TrainGroup", "policy_members", "baseline_rewards"]


class TrainGroup(tuple[Episode, ...]):
    """A group's episodes as a step trains them (a plain tuple to every backend), and siblings that
    count in its baseline only. Pickles whole (Ray, torchrun ranks)."""

    baseline: tuple[Episode, ...]

    def __new__(cls, episodes: Iterable[Episode], baseline: Iterable[Episode] = ()) -> TrainGroup:
        self = super().__new__(cls, episodes)
        self.baseline = tuple(baseline)
        return self


def policy_members(group: Sequence[Episode], policy_ends: Collection[EpisodeEnd]) -> list[Episode]:
    """The members of `group` that ended by the policy, in order: the ones that train."""
    return [ep for ep in group if ep.end in policy_ends]


def baseline_rewards(group: Sequence[Episode], policy_ends: Collection[EpisodeEnd]) -> list[float]:
    """The rewards that count in `group`'s baseline besides its members' own (policy ends only)."""
    extra = group.baseline if isinstance(group, TrainGroup) else ()
    return [ep.score for ep in policy_members(extra, policy_ends)]
