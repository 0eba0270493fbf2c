"""What of a leased group trains: its members that ended by the policy, and who sets their baseline.

Concept: a GRPO group's advantages are its members' rewards normalised over the group. Only
members whose end class (`Episode.end`) is a policy end (`TrainerConfig.policy_ends`) are
members for this purpose: an infrastructure failure (a sandbox that never started, a verifier
that crashed, a dead engine) says nothing about the policy, so it neither trains nor moves its
siblings' baseline; a policy end keeps its score (a timeout is an exit the policy learns to
avoid). A `TrainGroup` may also carry `baseline`: siblings whose rewards count in the baseline
(those of them that ended by the policy) but never train (stale episodes, under
`LoopConfig.stale_in_baseline`).

`has_signal` is the one judgement of whether a group is worth a step (dynamic sampling,
`rollout.dynamic_sampling`, applied by the loop's drain, trainer/loop.py): a group whose
trained members all get a zero advantage (every reward in its baseline equal, DAPO's and verl's
`filter_groups` criterion) carries no policy-gradient signal. The same members and baseline as
`flatten_groups`, so a group it keeps trains and a group it filters would have trained nothing.

Invariant (tests/test_learning_signal.py): a group's advantages are, bit for bit, those of the
same group with its infrastructure failures removed. Pure and torch-free (the loop imports it).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence

from miles_env.types import Episode, EpisodeEnd

__all__ = ["TrainGroup", "baseline_rewards", "has_signal", "policy_members"]


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


def has_signal(group: Sequence[Episode], policy_ends: Collection[EpisodeEnd]) -> bool:
    """Whether some member of `group` that trains gets a non-zero advantage: its reward differs from
    the mean over the members' and the baseline's rewards (grpo and dr_grpo alike: both subtract
    that mean). A group with no policy-ended member has none. The tolerance absorbs the mean's
    rounding (three rewards of 0.1 average to 0.10000000000000002)."""
    members = [ep.score for ep in policy_members(group, policy_ends)]
    if not members:
        return False
    rewards = members + baseline_rewards(group, policy_ends)
    mean = math.fsum(rewards) / len(rewards)
    tol = 1e-9 * max(1.0, abs(mean))
    return any(abs(r - mean) > tol for r in members)
