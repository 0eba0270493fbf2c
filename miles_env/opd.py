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
from miles_env.errors import ConfigError
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

    def __init__(self, engine: Engine) -> None:
        if not isinstance(engine, PromptScorer):
            raise ConfigError(f"opd.teacher: a {type(engine).__name__} cannot score prompts (PromptScorer)")
        self.engine, self.scorer = engine, engine
        self._busy = anyio.Lock()  # one call at a time: its seconds are the teacher's, not a queue's

    async def score_group(self, group: Sequence[Episode]) -> list[Episode]:
        """The group with every trajectory's `teacher_logprobs` filled, in one score call."""
        seqs = [traj.token_ids for ep in group for traj in ep.samples]
        async with self._busy:
            t0 = time.perf_counter()
            scored = iter(await self.scorer.score(seqs) if seqs else [])
            share = (time.perf_counter() - t0) / max(1, len(group))
        out = []
        for ep in group:
            samples = [_with_teacher(traj, next(scored)) for traj in ep.samples]
            timings = {**ep.timings, "teacher_s": share}
            out.append(ep.model_copy(update={"samples": samples, "timings": timings}))
        return out

    async def close(self) -> None:
        await self.engine.close()


async def build_teacher(cfg: OPDConfig) -> Teacher:
    """The teacher engine of `cfg.teacher`; a kind that cannot score is a ConfigError."""
    from miles_env.engines import build_engine

    engine: Engine = await build_engine(cfg.teacher)
    if not isinstance(engine, PromptScorer):
        await engine.close()
        raise ConfigError(f"opd.teacher.kind={cfg.teacher.kind!r}: this engine cannot score prompts")
    return Teacher(engine)


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
