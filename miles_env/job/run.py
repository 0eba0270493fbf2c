"""The main job: agentic RL in one process (`miles-env train CONFIG`).

This module only wires: config -> environment, harness, engine, stack (proxy, sandboxes),
replay queue, trainer (resolved and built by plan.py), then hands them to the one training loop
(`miles_env.trainer.loop.TrainLoop`), whose `StepHooks` `_Job` implements: rollouts into the
queue (in line for sync, concurrent producers for fully_async), weight sync after each step
(engine version = trainer step), eval every N steps, metrics and console output, and its rng
state in every checkpoint. Engine, proxy, sandboxes, rollouts, queue and trainer share one event
loop; the trainer's step runs in a worker thread so rollouts keep flowing.

A restart from the same run directory resumes from the last checkpoint: what it trained is acked,
what it had leased goes back to the queue; nothing is lost or trained twice (trainer/loop.py).
A group the killed job left open (fewer than group_size episodes put) is completed on resume with
its missing episodes, under its own group id, then trained like any other
(`groups_completed_on_resume` in the next step's metrics).
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from miles_env.config import RunConfig
from miles_env.cost import RunCost
from miles_env.engines.base import (
    Engine,
    PrefixCacheCounter,
    PrefixCacheStats,
)
from miles_env.errors import ConfigError
from miles_env.evals import build_evaluator
from miles_env.evals.base import EvalSetup, episode_stats
from miles_env.faults import FaultyEngine, FaultyProvider
from miles_env.job.plan import (
    Dispatch,
    JobPlan,
    build_job_trainer,
    job_engine,
    loop_config,
    plan_job,
    policy_ends,
    rollout_dispatch,
    write_resolved,
)
from miles_env.job.signal import SignalLedger
from miles_env.job.sync import build_syncer, sync_weights
from miles_env.jsonio import write_json
from miles_env.opd import Teacher, build_teacher, opd_metrics
from miles_env.queue.aio import AsyncReplayQueue
from miles_env.rollout import RolloutContext, run_valid_group
from miles_env.runlog import RunLog
from miles_env.trainer.loop import StepHooks, StepResult, TrainerBackend, TrainLoop
from miles_env.types import Episode, Task

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID


__all__ = ["run_training"]


class _Job(StepHooks):
    """The job's side of the training loop: rollouts, weight sync, eval, reporting."""

    produces = True  # produce() rolls the groups out (trainer/loop.py)

    def __init__(
        self,
        cfg: RunConfig,
        plan: JobPlan,
        *,
        contexts: tuple[RolloutContext, RolloutContext],  # (train, eval)
        queue: AsyncReplayQueue,
        trainer: TrainerBackend,
        engine: Engine,
        log: RunLog,
        console: Console,
        dispatch: Dispatch | None = None,
        teacher: Teacher | None = None,
    ) -> None:
        self.cfg, self.plan, self.log, self.console = cfg, plan, log, console
        self.teacher = teacher  # algorithm=opd: scores each group before it enters the queue
        self.dispatch = dispatch
        self.ctx, self.eval_ctx = contexts
        self.queue, self.trainer, self.engine = queue, trainer, engine
        self.rng = random.Random(cfg.seed)  # picks the tasks; its state is the job's task cursor
        self.syncer = build_syncer(cfg, self.engine)
        self.limiter = anyio.CapacityLimiter(max(1, cfg.rollout.concurrency // cfg.rollout.group_size))
        self.progress: Progress | None = None  # while the loop runs
        self.bar: TaskID | None = None
        self.cache_seen = PrefixCacheStats()  # the engine's prefix-cache counters at the last report
        self.completed_on_resume = 0  # open groups completed by a restart; in the next step's metrics
        # what the rollouts gave the trainer: end classes, re-rolls, drops, wasted seconds (signal.py)
        self.policy_ends = policy_ends(cfg)
        self.signal = SignalLedger(self.policy_ends, cfg.run_dir / "failed_episodes.jsonl")
        self.cost = RunCost(cfg.cost)  # spend so far (cost.py); its budget stops new rollouts
        setup = EvalSetup(
            cfg, plan.env, self.eval_ctx, plan.engine_cfg, trainer, plan.model_path, log, self.say, self.cost
        )
        self.evaluator = build_evaluator(setup)  # eval.mode; opened by run_training (miles_env/evals/)

    # -- StepHooks ---------------------------------------------------------------------------------
    async def produce(self, n_groups: int) -> None:
        if self.cost.exhausted:  # the budget is spent: no new rollouts (the loop ends the run)
            await anyio.sleep(0.2)
            return
        chosen = [self.rng.choice(self.plan.train_tasks) for _ in range(n_groups)]
        if self.dispatch is not None:  # cluster: rollout workers run the groups and put them
            await self.dispatch(chosen)
            return

        async def one(task: Task) -> None:
            scored = None
            while scored is None and not self.cost.exhausted:  # None: the teacher dropped the group
                group = await self._valid_group(task, self.cfg.rollout.group_size)  # (miles_env/opd.py):
                if not group:  # too few policy ends once the re-rolls ran out: dropped, counted
                    return  # (sync: the loop rolls another group out for the step)
                scored = await self._teacher_scored(group)  # the task is rolled out again
            for ep in scored or ():
                await self._put(ep)  # back-pressure: waits while too many complete groups are pending

        async with anyio.create_task_group() as tg:
            for task in chosen:
                tg.start_soon(one, task)

    async def _valid_group(self, task: Task, size: int, group_id: str | None = None) -> list[Episode]:
        """`size` episodes of `task` whose infrastructure failures were rolled out again
        (rollout.run_valid_group), recorded by the signal ledger; [] when the group was dropped."""
        r = self.cfg.rollout
        async with self.limiter:
            run = await run_valid_group(
                self.ctx, task, size, policy_ends=self.policy_ends,
                min_valid=None if r.min_valid is None else min(r.min_valid, size),
                attempts=r.reroll_attempts, group_id=group_id,
            )  # fmt: skip
        self.cost.add(run.rolled_out)
        self.signal.record(run, self.trainer.step)
        return run.episodes

    async def _teacher_scored(self, group: list[Episode]) -> list[Episode] | None:
        if self.teacher is None:
            return group
        scored = await self.teacher.score_group(group)
        if scored is None:
            self.say(f"opd: group {group[0].group_id} dropped, the teacher failed: {self.teacher.last_error}")
        return scored

    async def _put(self, ep: Episode) -> None:
        """queue.put, but once the budget is spent the wait for capacity ends: nobody may train
        again in this run, and the episode is kept for the next one."""
        while not self.cost.exhausted:
            with anyio.move_on_after(0.5):
                await self.queue.wait_for_capacity()
                break
        await anyio.to_thread.run_sync(partial(self.queue.sync.put, ep, block=False))

    def stop_reason(self) -> str | None:
        return self.cost.stop_reason()

    def checkpoint_state(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "cost": self.cost.state()}

    def restore(self, extra: Mapping[str, Any]) -> None:
        if "rng" in extra:  # JSON turned the state's tuples into lists
            version, internal, gauss = extra["rng"]
            self.rng.setstate((version, tuple(internal), gauss))
        self.cost.restore(extra.get("cost") or {})

    async def complete_open_groups(self) -> int:
        """On resume: run the missing episodes of every group the killed job left open (fewer than
        group_size put), under its own group id and task, so it is completed and trained, not
        skipped. Not on a cluster: there a lost worker's task is re-run whole and its short group
        stays open (INVARIANTS.md). Puts without waiting for capacity: the trainer is not taking yet."""
        if self.dispatch is not None:
            return 0
        tasks = {t.id: t for t in self.plan.train_tasks}
        size = self.cfg.rollout.group_size
        done = 0

        async def one(task: Task, group_id: str, missing: int) -> None:
            nonlocal done
            if self.cost.exhausted:  # a spent budget completes nothing: the group stays open
                return
            group = await self._valid_group(task, missing, group_id)
            if not group:  # its missing episodes kept failing: the group stays open
                return
            scored = await self._teacher_scored(group)
            for ep in scored or ():  # None: the teacher failed and the group stays open
                await anyio.to_thread.run_sync(partial(self.queue.sync.put, ep, block=False))
            done += scored is not None

        todo = [(tasks[g.task_id], g) for g in await self.queue.open_groups() if g.task_id in tasks]
        async with anyio.create_task_group() as tg:
            for task, g in todo:
                tg.start_soon(one, task, g.group_id, size - g.n_have)
        self.completed_on_resume = done
        return done

    async def after_step(self, step: int) -> dict[str, float]:
        return await self.sync_weights(step)

    async def report(self, result: StepResult) -> None:
        # reward and pass rate over every group drawn (dynamic sampling's filtered ones too): they
        # track the policy, not the filtered batch; cost too (those rollouts were paid for)
        episodes = [ep for g in (*result.groups, *result.filtered) for ep in g]
        metrics = {**result.metrics, **episode_stats(episodes), **self.signal.step_metrics(result.groups)}
        metrics.update(self.cost.step_metrics(result.step, episodes))  # cost_usd, cost_per_step_usd, ...
        if self.teacher is not None:  # opd/reverse_kl, opd/teacher_s, opd/teacher_share
            parts = ("rollout_s", "rollout_wait_s", "train_s", "checkpoint_s", "sync_s")
            metrics.update(opd_metrics(episodes, sum(metrics.get(k, 0.0) for k in parts)))
            metrics["opd/groups_dropped"] = float(self.teacher.take_dropped())
        if self.completed_on_resume:  # once, in the first step after the restart that completed them
            metrics["groups_completed_on_resume"] = float(self.completed_on_resume)
            self.completed_on_resume = 0
        sampled = [ep for ep in episodes if ep.sampled]  # an episode with no turn has no version
        metrics["staleness_mean"] = sum(result.step - 1 - ep.min_weight_version for ep in sampled) / max(
            1, len(sampled)
        )
        if self.dispatch is not None:  # cluster: nodes that rolled this step out (cluster/worker.py)
            nodes = {(ep.metadata.get("cluster") or {}).get("node_id") for ep in episodes}
            metrics["rollout_nodes"] = float(len(nodes))
        if isinstance(self.engine, PrefixCacheCounter):  # turns finished since the last report
            now = self.engine.prefix_cache_stats()
            metrics.update((now - self.cache_seen).metrics())
            self.cache_seen = now
        self.log.log(result.step, "train", metrics)
        if metrics.get("dynamic_sampling_skipped"):
            self.say(f"step {result.step} skipped (no update): dynamic sampling drew no group with signal")
        if self.progress is not None and self.bar is not None:
            self.progress.update(
                self.bar, completed=result.step, description=f"reward {metrics['reward_mean']:.2f}"
            )
        ds = "groups_filtered" in metrics  # dynamic sampling: drawn groups without signal (and their wait)
        rollout = metrics.get("rollout_s", 0.0) + metrics.get("rollout_wait_s", 0.0)
        filtered = (
            f"filtered {metrics['groups_filtered']:.0f}/{metrics['groups_drawn']:.0f} groups  " if ds else ""
        )
        self.console.print(
            f"step {result.step}/{self.cfg.trainer.steps}  reward {metrics['reward_mean']:.3f}  "
            f"pass {metrics['pass_rate']:.3f}  loss {metrics.get('loss', float('nan')):.4f}  "
            f"logp diff {metrics.get('logprob_diff_mean', float('nan')):.2e}  "
            f"train {metrics['train_s']:.0f}s  rollout {rollout:.0f}s  {filtered}"
            f"infra failed {metrics.get('wasted_rollout_share', 0.0):.0%} of rollout time "
            f"({metrics.get('episodes_rerolled', 0.0):.0f} re-rolled)  "
            f"cost ${metrics['cost_usd']:.4f} (total ${metrics['cost_usd_total']:.4f})"
        )

    async def evaluate(self, step: int) -> None:
        """The eval of `step`, unless the cost budget is spent (eval episodes count toward it)."""
        reason = self.cost.stop_reason()
        if reason is not None:
            self.log.log(step, "eval", {"eval_skipped": reason})
            self.say(f"[bold]eval[/] step {step} skipped: {reason}")
            return
        await self.evaluator.evaluate(step)

    # -- the job's own -----------------------------------------------------------------------------
    async def sync_weights(self, step: int) -> dict[str, float]:
        return await sync_weights(self.cfg, self.trainer, self.engine, self.syncer, step)

    def say(self, line: str) -> None:
        self.console.print(line)  # the progress bar's console while the loop runs


def _progress(console: Console) -> Progress:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("[bold]train[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    return Progress(*columns, console=console)


async def _follow(cfg: RunConfig, rank: int) -> dict[str, Any]:
    """A torchrun rank > 0: build the same trainer and repeat rank 0's calls (trainer/ranks.py)."""
    from miles_env.models import resolve_model
    from miles_env.trainer.ranks import follow, leave

    model = resolve_model(cfg.engine.model)
    trainer = await anyio.to_thread.run_sync(build_job_trainer, cfg, model)
    calls = await anyio.to_thread.run_sync(follow, trainer)
    del trainer  # freed by leave(), before the process group goes
    await anyio.to_thread.run_sync(leave)
    return {"rank": rank, "trainer_calls": calls}


async def run_training(cfg: RunConfig, console: Console) -> dict[str, Any]:
    """Run (or resume) the job described by `cfg`; return the final summary."""
    from miles_env.queue.config import build_queue
    from miles_env.stack import open_stack
    from miles_env.trainer.ranks import Leader, torchrun_rank

    started = time.time()
    rank, world = torchrun_rank()
    if world > 1 and cfg.trainer.backend not in ("megatron", "torch"):  # torch: FSDP2 (trainer/fsdp.py)
        raise ConfigError(
            f"torchrun with {world} processes: only trainer.backend=megatron|torch shard a model"
        )
    if rank > 0:
        return await _follow(cfg, rank)
    plan = plan_job(cfg)
    write_resolved(cfg, plan.env)
    log = RunLog(cfg.run_dir, config=cfg.logging)
    trainer = await anyio.to_thread.run_sync(build_job_trainer, cfg, plan.model_path)
    if world > 1:
        trainer = Leader(trainer)
    queue_sync = build_queue(
        cfg.queue,
        cfg.run_dir,
        group_size=cfg.rollout.group_size,
        max_pending_groups=2 * cfg.rollout.groups_per_step,
    )
    engine = await job_engine(cfg, plan)
    teacher = None if cfg.opd is None else await build_teacher(cfg.opd)
    faults = cfg.faults
    served = FaultyEngine(engine, faults) if faults is not None and faults.engine else engine  # the proxy's
    try:
        async with (
            open_stack(plan.stack_cfg, engine=served) as stack,
            rollout_dispatch(cfg, engine) as dispatch,
        ):
            timeout_s, limits = cfg.rollout.episode_timeout_s, cfg.rollout.limits
            ctx = replace(stack.rollout_context(plan.env, plan.harness, timeout_s, limits), guards=cfg.guards)
            if faults is not None and faults.sandbox_create > 0:  # train rollouts only: eval stays clean
                ctx = replace(ctx, provider=FaultyProvider(ctx.provider, faults.sandbox_create, faults.seed))
            eval_ctx = replace(
                stack.rollout_context(plan.env, plan.eval_harness, timeout_s, limits), guards=cfg.guards
            )
            queue = AsyncReplayQueue(queue_sync)
            job = _Job(cfg, plan, contexts=(ctx, eval_ctx), queue=queue, trainer=trainer, engine=engine,
                       log=log, console=console, dispatch=dispatch, teacher=teacher)  # fmt: skip
            async with job.evaluator:  # what eval.mode owns (a dedicated engine) lives for the run
                summary = await _run(job, TrainLoop(queue, trainer, loop_config(cfg), job))
    finally:
        if isinstance(trainer, Leader):
            await anyio.to_thread.run_sync(trainer.close)
        await engine.close()
        if teacher is not None:
            await teacher.close()
        log.close()
        queue_sync.close()
    summary = {**summary, "run_dir": str(cfg.run_dir), "wall_s": time.time() - started}
    write_json(cfg.run_dir / "summary.json", summary, default=float)
    return summary


async def _run(job: _Job, loop: TrainLoop) -> dict[str, Any]:
    """Resume, bring the engine to the trainer's weights, eval, train, eval."""
    cfg, trainer = job.cfg, job.trainer
    resumed = await loop.resume()
    if resumed is not None:
        job.console.print(
            f"resumed at step {resumed.step}: {resumed.acked} trained groups acked, "
            f"{resumed.released} returned to the queue"
        )
        await job.sync_weights(resumed.step)  # the engine must serve the weights the trainer resumed with
        if completed := await job.complete_open_groups():
            job.console.print(f"completed {completed} groups the previous run left open")
    elif (
        job.syncer is not None
    ):  # both loaded one model; if they differ, the first delta is refused, repaired
        job.syncer.assume(await anyio.to_thread.run_sync(trainer.state_dict), 0)
    before = 0 if cfg.eval.enabled and trainer.step == 0 else None
    if before is not None:
        await job.evaluate(before)
    with _progress(job.console) as progress:
        console = job.console
        job.progress, job.console = progress, progress.console
        job.bar = progress.add_task("starting", total=cfg.trainer.steps, completed=trainer.step)
        await loop.run()
    job.progress, job.console = None, console
    if loop.stopped is not None:  # the cost budget: rollouts stopped, the last step is checkpointed
        job.console.print(f"[bold]stopped[/] at step {trainer.step}/{cfg.trainer.steps}: {loop.stopped}")
    if cfg.eval.enabled and loop.stopped is None:  # a spent budget starts no eval rollouts either
        await job.evaluate(trainer.step)
    await job.evaluator.drain()  # evals still running in the background (dedicated, external)
    job.console.print(job.signal.summary_line())  # what ended how: infrastructure failures never trained
    job.console.print(job.cost.report_line(trainer.step))  # the last line: every eval's cost in it
    results = job.evaluator.results
    before_row = None if before is None else results.get(before)
    after = results.get(trainer.step) if cfg.eval.enabled else None
    cost = job.cost.summary(trainer.step)
    signal = job.signal.summary()
    return {
        "steps": trainer.step,
        "eval_before": before_row,
        "eval_after": after,
        "cost": cost,
        "signal": signal,
    }
