"""The job's account of what its rollouts gave the trainer: what ended how, what was rolled again.

Concept: every group the job rolls out (`rollout.run_valid_group`) is recorded as it ends: each
episode's end class, the failed members rolled out again, the groups dropped once the attempts ran
out, and the rollout seconds each cost. `step_metrics` turns what accumulated since the previous
report into the step's metrics: `ends/<class>` (the share of every episode rolled out, the
re-rolled and dropped ones included, that ended so), `episodes_rerolled`, `groups_dropped_invalid`,
`episodes_excluded` (infrastructure failures inside the trained groups, left out by the trainer),
`trained_episodes`, `rollouts_per_trained_group` (every episode rolled out, over the groups
trained: group_size plus re-rolls, plus dynamic sampling's filtered groups) and
`wasted_rollout_share` (the share of rollout seconds spent on episodes that never train:
failures and dropped groups; a filtered group's episodes ended by the policy and count as
used). `summary()` is the whole run's: episodes by end class, re-rolled and dropped, for
summary.json and the run's last lines. Failed train episodes that never reach the queue
(replaced, or their group dropped) are appended to `RUN_DIR/failed_episodes.jsonl` (no token
arrays: their journals are in sessions/), so `miles-env view` lists them with their class.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from miles_env.jsonio import dumps
from miles_env.rollout import GroupRun
from miles_env.types import Episode, EpisodeEnd

__all__ = ["SignalLedger"]


def _seconds(ep: Episode) -> float:
    return float(ep.timings.get("total_s", 0.0))


@dataclass
class SignalLedger:
    policy_ends: Collection[EpisodeEnd]
    path: Path  # failed_episodes.jsonl
    ends: Counter[EpisodeEnd] = field(default_factory=Counter)
    rerolled: int = 0
    dropped: int = 0
    seconds: float = 0.0  # rollout seconds of every episode recorded since the last report
    wasted_s: float = 0.0  # of them, episodes that never train
    run_ends: Counter[EpisodeEnd] = field(default_factory=Counter)  # the whole run's
    run_rerolled: int = 0
    run_dropped: int = 0

    def record(self, run: GroupRun, step: int) -> None:
        """A group that ended (queued or dropped): count it, write its unqueued failures."""
        self.ends.update(ep.end for ep in run.rolled_out)
        self.run_ends.update(ep.end for ep in run.rolled_out)
        self.rerolled += run.rerolled
        self.dropped += run.dropped
        self.run_rerolled += run.rerolled
        self.run_dropped += run.dropped
        self.seconds += sum(_seconds(ep) for ep in run.rolled_out)
        never = [*run.replaced, *(ep for ep in run.episodes if ep.end not in self.policy_ends)]
        self.wasted_s += sum(_seconds(ep) for ep in never)
        if run.replaced:
            with self.path.open("a") as fh:
                for ep in run.replaced:
                    body = json.loads(ep.model_dump_json(exclude={"samples"}))
                    fh.write(dumps({"step": step, "dropped": run.dropped, **body}) + "\n")

    def step_metrics(self, groups: Sequence[Sequence[Episode]]) -> dict[str, float]:
        """The step's metrics (module docstring), then the counts start again."""
        n = sum(self.ends.values())  # 0 on a cluster (its workers roll out): episode_stats' ends/* stand
        out = {f"ends/{end.value}": self.ends[end] / n for end in EpisodeEnd} if n else {}
        trained = sum(1 for g in groups for ep in g if ep.end in self.policy_ends)
        out |= {
            "episodes_rerolled": float(self.rerolled),
            "groups_dropped_invalid": float(self.dropped),
            "episodes_excluded": float(sum(len(g) for g in groups) - trained),
            "trained_episodes": float(trained),
            "rollouts_per_trained_group": n / len(groups) if groups else float(n),
            "rollout_episode_s": self.seconds,  # the episodes' own seconds (concurrent ones add up)
            "wasted_rollout_share": self.wasted_s / self.seconds if self.seconds else 0.0,
        }
        self.ends.clear()
        self.rerolled = self.dropped = 0
        self.seconds = self.wasted_s = 0.0
        return out

    def summary(self) -> dict[str, object]:
        """The run's episodes by end class (policy ends first), re-rolled and dropped."""
        ends = sorted(
            self.run_ends.items(), key=lambda kv: (kv[0] not in self.policy_ends, -kv[1], kv[0].value)
        )
        infra = sum(n for e, n in self.run_ends.items() if e not in self.policy_ends)
        return {
            "ends": {e.value: n for e, n in ends},
            "infra_failures": infra,
            "episodes_rerolled": self.run_rerolled,
            "groups_dropped_invalid": self.run_dropped,
        }

    def summary_line(self) -> str:
        s = self.summary()
        ends = ", ".join(f"{k} {n}" for k, n in s["ends"].items()) or "none"  # type: ignore[attr-defined]
        return (
            f"episodes by end: {ends}; infrastructure failures never trained: {s['infra_failures']} "
            f"(re-rolled {s['episodes_rerolled']}, groups dropped {s['groups_dropped_invalid']})"
        )
