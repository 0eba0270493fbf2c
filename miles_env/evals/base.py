"""What every eval mode shares: its setup, the background-task plumbing, and the eval episodes.

Concept: an `Evaluator` is an async context manager the job holds for the whole run. It opens
what its mode owns (`open`), then the job calls `evaluate(step)` at every eval point (before
training, every `eval.every` steps, after training) and `drain()` before it writes the summary.
A mode that must not hold up training hands its work to `in_background`, whose tasks live in
the evaluator's task group; `record` wraps every eval so that one that raises becomes a logged
`eval_error` row under its step, never a crashed run. `results` maps each finished step to the
metrics it logged (the summary's eval_before and eval_after). Closing waits for what is still
running, then closes what `open` opened (in that order: the tasks need it).

`episode_stats` is the one set of episode metrics, a train step's (job/run.py) and an eval row's:
reward, pass rate, statuses, tokens, cost, and `flags/<name>` (the fraction of episodes raising
each guard flag, every known flag always present) with `flags/zeroed` (the fraction whose reward a
flag set to 0). Eval episodes are counted into the run's cost (`EvalSetup.cost`) as each one ends,
so they spend the same `cost.budget_usd` as the training rollouts.
"""

from __future__ import annotations

import abc
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import anyio

from miles_env.guards.config import FLAGS
from miles_env.jsonio import dumps
from miles_env.rollout import RolloutContext, run_many
from miles_env.types import Episode, EpisodeEnd, Task

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from miles_env.config import RunConfig
    from miles_env.cost import RunCost
    from miles_env.engines.configs import EngineConfig
    from miles_env.environment import Environment
    from miles_env.runlog import RunLog
    from miles_env.trainer.loop import TrainerBackend

__all__ = [
    "EvalSetup", "Evaluator", "end_rates", "episode_stats", "filter_tiers", "flag_rates", "run_eval_episodes",
    "zeroed_by",
]  # fmt: skip

Metrics = dict[str, Any]


@dataclass(frozen=True, slots=True)
class EvalSetup:
    """What the job hands its evaluator (built before anything is opened)."""

    cfg: RunConfig
    env: Environment
    context: RolloutContext  # eval episodes on the rollout stack: the eval harness, timeouts, limits
    engine_cfg: EngineConfig  # the run's engine, resolved (seed, log_dir)
    trainer: TrainerBackend
    model_path: Path  # the trained model's directory (its tokenizer files travel with an export)
    log: RunLog
    say: Callable[[str], None]  # a console line (the job's console, progress bar or not)
    cost: RunCost | None = None  # the run's spend: eval episodes count toward its budget (cost.py)


def filter_tiers(tasks: list[Task], tiers: list[int] | None) -> list[Task]:
    if not tiers:
        return tasks
    return [t for t in tasks if t.metadata.get("tier") in tiers]


def zeroed_by(ep: Episode) -> list[str]:
    """The flags that set `ep`'s reward to 0 (`miles_env.guards.zero_flagged` records them)."""
    note = ep.reward.details.get("guards") if ep.reward is not None else None
    return list(note.get("zeroed_by") or []) if isinstance(note, dict) else []


def flag_rates(episodes: list[Episode], prefix: str = "") -> dict[str, float]:
    """`flags/<name>`: the fraction of episodes raising each known flag (0 when none did), and
    `flags/zeroed`: the fraction whose reward a flag set to 0 (guards.zero_reward_on)."""
    n = len(episodes) or 1
    out = {f"{prefix}flags/{name}": sum(1 for e in episodes if name in e.flags) / n for name in FLAGS}
    out[f"{prefix}flags/zeroed"] = sum(1 for e in episodes if zeroed_by(e)) / n
    return out


def end_rates(episodes: list[Episode], prefix: str = "") -> dict[str, float]:
    """`ends/<class>`: the fraction of episodes that ended in each class (types.EpisodeEnd; 0 when
    none did, so every class has a curve)."""
    n = len(episodes) or 1
    return {f"{prefix}ends/{end.value}": sum(1 for e in episodes if e.end is end) / n for end in EpisodeEnd}


def episode_stats(episodes: list[Episode], prefix: str = "") -> dict[str, float]:
    """The metrics of a batch of episodes: a train step's (job/run.py) or an eval row's. `pass_rate`
    counts every episode; `pass_rate_policy` only those that ended by the policy (an
    infrastructure failure says nothing of it): the two differ by what failed around the policy."""
    n = len(episodes) or 1
    passed = [e for e in episodes if e.reward is not None and e.reward.passed]
    policy = [e for e in episodes if e.end.policy]
    return {
        f"{prefix}reward_mean": sum(e.score for e in episodes) / n,
        f"{prefix}pass_rate": len(passed) / n,
        f"{prefix}pass_rate_policy": sum(1 for e in passed if e.end.policy) / (len(policy) or 1),
        f"{prefix}episodes": float(len(episodes)),
        f"{prefix}failed": float(sum(1 for e in episodes if e.status.value in ("failed", "aborted"))),
        f"{prefix}sampled_tokens": float(sum(s.n_sampled for e in episodes for s in e.samples)),
        f"{prefix}cost_usd": sum(e.usage.price_usd for e in episodes if e.usage is not None),  # cost.py
        f"{prefix}sandbox_s": sum(e.usage.sandbox_s for e in episodes if e.usage is not None),
        **flag_rates(episodes, prefix),
        **end_rates(episodes, prefix),
    }


async def run_eval_episodes(
    setup: EvalSetup, ctx: RolloutContext, step: int, extra: Mapping[str, Any] | None = None
) -> Metrics:
    """Run the eval split on `ctx`, log an `eval` row under `step` (with `extra`), append the
    episodes to eval_episodes.jsonl, print a line; the row's metrics."""
    cfg = setup.cfg
    tasks = filter_tiers(setup.env.tasks(cfg.eval.split), cfg.eval.tiers)
    t0 = time.perf_counter()
    cost = setup.cost
    count = None if cost is None else (lambda ep: cost.add_eval([ep]))  # as each ends: the budget sees it
    episodes = await run_many(
        ctx, tasks, rollouts_per_task=cfg.eval.rollouts, concurrency=cfg.rollout.concurrency, on_episode=count
    )
    stats: Metrics = {**episode_stats(episodes), "eval_s": time.perf_counter() - t0, **(extra or {})}
    setup.log.log(step, "eval", stats)
    with (cfg.run_dir / "eval_episodes.jsonl").open("a") as fh:
        for ep in episodes:
            fh.write(dumps({"step": step, **json.loads(ep.model_dump_json(exclude={"samples"}))}) + "\n")
    setup.say(
        f"[bold]eval[/] step {step}: pass rate {stats['pass_rate']:.3f}, mean reward {stats['reward_mean']:.3f} "
        f"({len(episodes)} episodes, {stats['eval_s']:.0f}s)"
    )
    return stats


class Evaluator(abc.ABC):
    """One eval mode; see the module docstring. Subclasses implement `evaluate` (and `open`)."""

    def __init__(self, setup: EvalSetup) -> None:
        self.setup = setup
        self.results: dict[int, Metrics] = {}  # step -> the metrics logged for it
        self._pending: list[anyio.Event] = []
        self._tg: TaskGroup | None = None
        self._exit = AsyncExitStack()

    async def open(self, stack: AsyncExitStack) -> None:  # noqa: B027 - optional hook
        """Open what this mode owns (an engine, a stack) on `stack`; closed after the last eval."""

    @abc.abstractmethod
    async def evaluate(self, step: int) -> None:
        """Evaluate the trainer's weights at `step` (now, or in the background)."""

    async def drain(self) -> None:
        """Wait for every eval still running."""
        while self._pending:
            await self._pending.pop(0).wait()

    async def __aenter__(self) -> Self:
        await self.open(self._exit)
        self._tg = await self._exit.enter_async_context(anyio.create_task_group())
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return await self._exit.__aexit__(kind, exc, tb)

    def in_background(self, step: int, work: Callable[[], Awaitable[Metrics]]) -> None:
        """Run `work` (recorded) in the evaluator's own task; `drain()` waits for it."""
        if self._tg is None:
            raise RuntimeError("an Evaluator runs inside `async with evaluator:`")
        done = anyio.Event()
        self._pending.append(done)

        async def run() -> None:
            try:
                await self.record(step, work)
            finally:
                done.set()

        self._tg.start_soon(run)

    async def record(self, step: int, work: Callable[[], Awaitable[Metrics]]) -> None:
        """Await `work` and keep its metrics; one that raises is an `eval_error` row, and the run goes on."""
        try:
            self.results[step] = await work()
        except Exception as e:  # recorded: a broken eval is data, not a crashed run
            self.fail(step, e)

    def fail(self, step: int, error: Exception) -> None:
        """Log `error` as the `eval_error` row of `step` (one line) and say so."""
        line = (f"{type(error).__name__}: {error}".splitlines() or [""])[0]
        self.results[step] = {"eval_error": line}
        self.setup.log.log(step, "eval", self.results[step])
        self.setup.say(f"[bold red]eval[/] step {step} failed: {line}")
