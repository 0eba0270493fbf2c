"""On-policy distillation (`algorithm: opd`): a teacher engine scores what the student sampled.

Concept: the student (the run's engine) samples episodes as usual. Before a group enters the
replay queue, the teacher, any engine kind that is a `PromptScorer` (engines/base.py), scores
every trajectory of the group in one prefill-only call; each trajectory then carries
`teacher_logprobs` (0.0 where the loss mask is 0). The trainer turns them into per-token
advantages, `kl_weight * (teacher - student) + reward_weight * A_grpo`
(trainer/torch_backend.py `opd_token_advantages`): the student's sampled-token logprob is the
rollout's, so `student - teacher` at a sampled token is the usual one-sample estimate of the
reverse KL(student || teacher), and the policy gradient lowers it.

Cost: a group's teacher seconds are spread over its episodes (`timings["teacher_s"]`), so a
step's `opd/teacher_s` is the teacher time of exactly the groups it trained, also after a
restart; the teacher serves one group at a time, so these are its busy seconds, not time queued
behind another group. `opd/teacher_share` is that over the step's wall time (rollout, wait,
train, checkpoint and weight sync).

Faults: a teacher call that raises or runs past `opd.timeout_s` drops that one group (it has no
teacher signal to train on; `score_group` returns None, the job logs why, and the step reports
`opd/groups_dropped`); the run goes on. `opd.max_consecutive_failures` failed groups in a row
mean the teacher is gone, not flaky: that raises EngineError and ends the run with the last cause.

Layering: core; the teacher engine is built by name (`build_engine`), imported lazily.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Literal

import anyio
from pydantic import BaseModel, ConfigDict, Field

from miles_env.engines.base import Engine, PromptScorer
from miles_env.engines.configs import EngineConfig
from miles_env.errors import ConfigError, EngineError
from miles_env.types import Episode, Trajectory

__all__ = ["Algorithm", "OPDConfig", "Teacher", "build_teacher", "opd_metrics", "trainer_options"]

Algorithm = Literal["grpo", "opd"]
LOGPROB_FLOOR = -1e4  # a teacher logprob of -inf (an impossible token) is stored as this: strict JSON


class OPDConfig(BaseModel):
    """The `opd` section: the teacher engine and how its signal mixes with the task reward."""

    model_config = ConfigDict(extra="forbid")

    teacher: EngineConfig = Field(description="the teacher engine (any kind that scores prompts)")
    kl_weight: float = Field(1.0, gt=0, description="weight of the per-token teacher signal")
    reward_weight: float = Field(0.0, ge=0, description="weight of the GRPO advantage; 0 = pure OPD")
    timeout_s: float = Field(
        600.0, gt=0, description="one group's teacher call; past it the group is dropped"
    )
    max_consecutive_failures: int = Field(
        3, ge=1, description="failed groups in a row that end the run (the teacher is gone)"
    )


def trainer_options(cfg: OPDConfig | None) -> dict[str, float]:
    """The TrainerConfig fields that switch the loss to OPD; none without an `opd` section."""
    if cfg is None:
        return {}
    return {"opd_kl_weight": cfg.kl_weight, "opd_reward_weight": cfg.reward_weight}


def _with_teacher(traj: Trajectory, scored: list[float]) -> Trajectory:
    teacher = [max(lp, LOGPROB_FLOOR) if m else 0.0 for m, lp in zip(traj.loss_mask, scored, strict=True)]
    return traj.model_copy(update={"teacher_logprobs": teacher})


class Teacher:
    """A PromptScorer engine that scores groups of episodes; owns the engine (closes it)."""

    def __init__(
        self, engine: Engine, *, timeout_s: float = 600.0, max_consecutive_failures: int = 3
    ) -> None:
        if not isinstance(engine, PromptScorer):
            raise ConfigError(f"opd.teacher: a {type(engine).__name__} cannot score prompts (PromptScorer)")
        self.engine, self.scorer = engine, engine
        self.timeout_s, self.max_failures = timeout_s, max_consecutive_failures
        self._busy = anyio.Lock()  # one call at a time: its seconds are the teacher's, not a queue's
        self.failures = 0  # failed groups in a row
        self.dropped = 0  # groups dropped since the last `take_dropped`
        self.last_error = ""

    async def score_group(self, group: Sequence[Episode]) -> list[Episode] | None:
        """The group with every trajectory's `teacher_logprobs` filled, in one score call; None
        when the call failed or timed out (the group is dropped; `last_error` says why)."""
        seqs = [traj.token_ids for ep in group for traj in ep.samples]
        async with self._busy:
            t0 = time.perf_counter()
            try:
                with anyio.fail_after(self.timeout_s):
                    scored_all = await self.scorer.score(seqs) if seqs else []
                if len(scored_all) != len(seqs):
                    raise EngineError(f"scored {len(scored_all)} sequences of {len(seqs)}")
            except Exception as e:  # noqa: BLE001 - any teacher fault ends this group, not the run
                self._failed(e)
                return None
            share = (time.perf_counter() - t0) / max(1, len(group))
        self.failures = 0
        scored = iter(scored_all)
        out = []
        for ep in group:
            samples = [_with_teacher(traj, next(scored)) for traj in ep.samples]
            timings = {**ep.timings, "teacher_s": share}
            out.append(ep.model_copy(update={"samples": samples, "timings": timings}))
        return out

    def _failed(self, e: Exception) -> None:
        cause = (
            f"timed out after {self.timeout_s:g} s"
            if isinstance(e, TimeoutError)
            else f"{type(e).__name__}: {e}"
        )
        self.failures, self.dropped, self.last_error = self.failures + 1, self.dropped + 1, cause
        if self.failures >= self.max_failures:
            raise EngineError(f"opd teacher failed {self.failures} groups in a row; last: {cause}") from e

    def take_dropped(self) -> int:
        """Groups dropped since the last call (the step's `opd/groups_dropped`)."""
        n, self.dropped = self.dropped, 0
        return n

    async def close(self) -> None:
        await self.engine.close()


async def build_teacher(cfg: OPDConfig) -> Teacher:
    """The teacher engine of `cfg.teacher`; a kind that cannot score is a ConfigError."""
    from miles_env.engines import build_engine

    engine: Engine = await build_engine(cfg.teacher)
    if not isinstance(engine, PromptScorer):
        await engine.close()
        raise ConfigError(f"opd.teacher.kind={cfg.teacher.kind!r}: this engine cannot score prompts")
    return Teacher(engine, timeout_s=cfg.timeout_s, max_consecutive_failures=cfg.max_consecutive_failures)


def opd_metrics(episodes: Sequence[Episode], step_s: float) -> dict[str, float]:
    """opd/reverse_kl: mean over sampled tokens of (student - teacher) logprob; opd/teacher_s and
    opd/teacher_share (of `step_s`); opd/teacher_tokens: tokens the teacher scored."""
    diff, tokens, scored = 0.0, 0, 0
    for ep in episodes:
        for traj in ep.samples:
            if traj.teacher_logprobs is None:
                continue
            scored += len(traj.token_ids)
            for m, s, t in zip(traj.loss_mask, traj.logprobs, traj.teacher_logprobs, strict=True):
                if m:
                    diff, tokens = diff + (s - t), tokens + 1
    teacher_s = sum(ep.timings.get("teacher_s", 0.0) for ep in episodes)
    return {
        "opd/reverse_kl": diff / tokens if tokens else math.nan,
        "opd/teacher_s": teacher_s,
        "opd/teacher_share": teacher_s / step_s if step_s > 0 else math.nan,
        "opd/teacher_tokens": float(scored),
    }
