"""The main job: agentic RL in one process (`miles-env train CONFIG`).

Engine, TITO proxy, sandboxes, rollout workers, replay queue and trainer share
one event loop; the trainer's step runs in a worker thread so rollouts keep
flowing (fully_async). Lifecycle of a step: rollout groups -> queue.put ->
queue.take (staleness filter) -> train_step -> checkpoint (with the trained
episode ids) -> ack -> weight sync (engine version = trainer step). A restart
from the same run directory resumes from the last checkpoint: what it trained
is acked, what it had leased goes back to the queue; nothing is lost or trained twice.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import yaml

from miles_env.config import Mode, RunConfig
from miles_env.environment import Environment
from miles_env.errors import ConfigError
from miles_env.jsonio import dumps, write_json
from miles_env.rollout import RolloutContext, run_group, run_many
from miles_env.runlog import RunLog
from miles_env.types import Episode, Task

__all__ = ["run_training", "TrainState"]


@dataclass
class TrainState:
    step: int = 0
    trained_ids: list[str] = field(default_factory=list)
    episodes: int = 0
    started: float = field(default_factory=time.time)


def _filter_tiers(tasks: list[Task], tiers: list[int] | None) -> list[Task]:
    if not tiers:
        return tasks
    return [t for t in tasks if t.metadata.get("tier") in tiers]


def _episode_stats(episodes: list[Episode], prefix: str = "") -> dict[str, float]:
    n = len(episodes) or 1
    out = {
        f"{prefix}reward_mean": sum(e.score for e in episodes) / n,
        f"{prefix}pass_rate": sum(1 for e in episodes if e.reward is not None and e.reward.passed) / n,
        f"{prefix}episodes": float(len(episodes)),
        f"{prefix}failed": float(sum(1 for e in episodes if e.status.value in ("failed", "aborted"))),
        f"{prefix}sampled_tokens": float(sum(s.n_sampled for e in episodes for s in e.samples)),
    }
    return out


def build_trainer(cfg: RunConfig, model_path: Path) -> Any:
    from pydantic import ValidationError

    if cfg.trainer.backend not in ("torch", "megatron"):
        raise ConfigError(f"trainer.backend={cfg.trainer.backend!r}: known backends: torch, megatron")
    if cfg.trainer.backend == "megatron":
        from miles_env.trainer.megatron_backend import MegatronTrainer as TorchTrainer  # same interface
        from miles_env.trainer.megatron_backend import MegatronTrainerConfig as TrainerConfig
    else:
        from miles_env.trainer.config import TrainerConfig  # type: ignore[assignment]
        from miles_env.trainer.torch_backend import TorchTrainer  # type: ignore[assignment]

    options = {
        "seed": cfg.seed,
        "keep_checkpoints": cfg.trainer.keep_checkpoints,
        **cfg.trainer.backend_options,
    }
    try:
        tcfg = TrainerConfig(**options)
    except ValidationError as e:
        msg = "; ".join(f"trainer.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"invalid trainer config: {msg}") from e
    return TorchTrainer(model_path, tcfg)


def _nbytes(trainer: Any) -> int:
    seen: set[int] = set()
    total = 0
    for _, p in trainer.named_parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _build_syncer(cfg: RunConfig, trainer: Any, engine: Any, step: int) -> Any:
    import torch

    from miles_env.trainer.weight_sync import WeightSyncer

    dtype = getattr(getattr(engine, "model", None), "dtype", torch.float32)
    transport = "disk" if cfg.weight_sync == "delta_disk" else "in_process"
    syncer = WeightSyncer(mode="delta", transport=transport, dtype=dtype, workdir=cfg.run_dir / "weights")
    if step == 0:  # both loaded the same checkpoint; if not, the first delta is refused and repaired
        syncer.assume(trainer.state_dict(), int(getattr(engine, "weight_version", 0)))
    return syncer


class _Job:
    def __init__(self, cfg: RunConfig, log: RunLog, console: Any) -> None:
        self.cfg = cfg
        self.log = log
        self.console = console
        self.rng = random.Random(cfg.seed)
        self.state = TrainState()
        self.progress: Any = None  # a rich Progress, while the loop runs
        self.bar: Any = None

    # -- rollouts --------------------------------------------------------------------------
    async def _produce_groups(
        self, ctx: RolloutContext, queue: Any, tasks: list[Task], n_groups: int
    ) -> list[Episode]:
        chosen = [self.rng.choice(tasks) for _ in range(n_groups)]
        produced: list[Episode] = []
        limiter = anyio.CapacityLimiter(max(1, self.cfg.rollout.concurrency // self.cfg.rollout.group_size))

        async def one(task: Task) -> None:
            async with limiter:
                group = await run_group(ctx, task, self.cfg.rollout.group_size)
            for ep in group:
                await queue.put(ep)
            produced.extend(group)

        async with anyio.create_task_group() as tg:
            for task in chosen:
                tg.start_soon(one, task)
        return produced

    async def evaluate(self, ctx: RolloutContext, env: Environment, step: int) -> dict[str, float]:
        ev = self.cfg.eval
        tasks = _filter_tiers(env.tasks(ev.split), ev.tiers)
        t0 = time.perf_counter()
        episodes = await run_many(
            ctx, tasks, rollouts_per_task=ev.rollouts, concurrency=self.cfg.rollout.concurrency
        )
        stats = _episode_stats(episodes)
        stats["eval_s"] = time.perf_counter() - t0
        self.log.log(step, "eval", stats)
        with (self.cfg.run_dir / "eval_episodes.jsonl").open("a") as fh:
            for ep in episodes:
                fh.write(dumps({"step": step, **json.loads(ep.model_dump_json(exclude={"samples"}))}) + "\n")
        self.console.print(
            f"[bold]eval[/] step {step}: pass rate {stats['pass_rate']:.3f}, mean reward {stats['reward_mean']:.3f} "
            f"({len(episodes)} episodes, {stats['eval_s']:.0f}s)"
        )
        return stats

    # -- training --------------------------------------------------------------------------
    async def _train_on(self, trainer: Any, queue: Any, leases: list[Any]) -> dict[str, Any]:
        groups = [list(lease.episodes) for lease in leases]
        t0 = time.perf_counter()
        metrics: dict[str, Any] = await anyio.to_thread.run_sync(trainer.train_step, groups)
        metrics["train_s"] = time.perf_counter() - t0
        self.state.step += 1
        ids = [ep.id for g in groups for ep in g]
        self.state.trained_ids.extend(ids)
        if (
            self.state.step % self.cfg.trainer.checkpoint_every == 0
            or self.state.step == self.cfg.trainer.steps
        ):
            t1 = time.perf_counter()
            extra = {
                "step": self.state.step,
                "trained_ids": self.state.trained_ids,
                "rng": self.rng.getstate(),
            }
            await anyio.to_thread.run_sync(trainer.save_checkpoint, self.cfg.run_dir / "checkpoints", extra)
            metrics["checkpoint_s"] = time.perf_counter() - t1
            # Only after the checkpoint holding these ids is durable; with checkpoint_every > 1 the
            # steps since the last checkpoint are acked here too (their ids are in it).
            await queue.ack(self._unacked + leases)
            self._unacked.clear()
        else:
            self._unacked.extend(leases)
        episodes = [ep for g in groups for ep in g]
        metrics.update(_episode_stats(episodes))
        metrics["staleness_mean"] = sum(self.state.step - 1 - ep.min_weight_version for ep in episodes) / max(
            1, len(episodes)
        )
        return metrics

    async def _sync_weights(self, trainer: Any, engine: Any) -> dict[str, float]:
        """Engine version := trainer step. Returns sync_s, sync_bytes (moved) and, for delta, more."""
        if self.cfg.weight_sync.startswith("delta"):
            state = await anyio.to_thread.run_sync(trainer.state_dict)
            return dict(await self._syncer.sync(engine, state, self.state.step))
        t0 = time.perf_counter()
        # A remote engine (vllm, sglang) has no update_weights: it always syncs through disk.
        if self.cfg.weight_sync == "in_process" and hasattr(engine, "update_weights"):
            state = await anyio.to_thread.run_sync(trainer.state_dict)
            await engine.update_weights(state, weight_version=self.state.step)
        else:
            path = await anyio.to_thread.run_sync(trainer.export_weights, self.cfg.run_dir / "weights")
            await engine.update_weights_from_disk(path, weight_version=self.state.step)
        return {"sync_s": time.perf_counter() - t0, "sync_bytes": float(_nbytes(trainer))}

    def _report(self, metrics: dict[str, Any]) -> None:
        self.log.log(self.state.step, "train", metrics)
        if self.progress is not None:
            self.progress.update(
                self.bar, completed=self.state.step, description=f"reward {metrics['reward_mean']:.2f}"
            )
        self.console.print(
            f"step {self.state.step}/{self.cfg.trainer.steps}  reward {metrics['reward_mean']:.3f}  "
            f"pass {metrics['pass_rate']:.3f}  loss {metrics.get('loss', float('nan')):.4f}  "
            f"logp diff {metrics.get('logprob_diff_mean', float('nan')):.2e}  "
            f"train {metrics['train_s']:.0f}s  rollout {metrics.get('rollout_s', 0.0):.0f}s"
        )

    async def _take(self, queue: Any, n: int, version: int) -> list[Any]:
        """Wait until `n` complete, fresh-enough groups are available and lease them."""
        leases: list[Any] = []
        while len(leases) < n:
            got = await queue.take(
                n - len(leases),
                current_version=version,
                max_staleness=self.cfg.rollout.max_staleness,
                lease_s=24 * 3600.0,  # acked after the checkpoint; a restart recovers, not the lease timer
            )
            leases.extend(got)
            if len(leases) < n:
                await anyio.sleep(0.2)
        return leases

    async def run_sync(
        self, ctx: RolloutContext, queue: Any, trainer: Any, engine: Any, tasks: list[Task]
    ) -> None:
        cfg = self.cfg
        while self.state.step < cfg.trainer.steps:
            t0 = time.perf_counter()
            await self._produce_groups(ctx, queue, tasks, cfg.rollout.groups_per_step)
            rollout_s = time.perf_counter() - t0
            leases = await self._take(queue, cfg.rollout.groups_per_step, self.state.step)
            metrics = await self._train_on(trainer, queue, leases)
            metrics["rollout_s"] = rollout_s
            metrics.update(await self._sync_weights(trainer, engine))
            metrics["episodes_per_min"] = metrics["episodes"] / max(1e-9, (time.perf_counter() - t0) / 60)
            self._report(metrics)
            await self._maybe_eval(ctx)

    async def run_fully_async(
        self, ctx: RolloutContext, queue: Any, trainer: Any, engine: Any, tasks: list[Task]
    ) -> None:
        cfg = self.cfg
        async with anyio.create_task_group() as tg:

            async def producer() -> None:
                while True:  # back-pressure: queue.put waits while too many complete groups are pending
                    await self._produce_groups(ctx, queue, tasks, 1)

            for _ in range(max(1, cfg.rollout.concurrency // cfg.rollout.group_size)):
                tg.start_soon(producer)
            while self.state.step < cfg.trainer.steps:
                t0 = time.perf_counter()
                leases = await self._take(queue, cfg.rollout.groups_per_step, self.state.step)
                wait_s = time.perf_counter() - t0
                metrics = await self._train_on(trainer, queue, leases)
                metrics["rollout_wait_s"] = wait_s
                metrics.update(await self._sync_weights(trainer, engine))
                metrics["episodes_per_min"] = metrics["episodes"] / max(1e-9, (time.perf_counter() - t0) / 60)
                self._report(metrics)
                await self._maybe_eval(ctx)
            tg.cancel_scope.cancel()

    async def _maybe_eval(self, ctx: RolloutContext) -> None:
        ev = self.cfg.eval
        if (
            ev.enabled
            and ev.every
            and self.state.step % ev.every == 0
            and self.state.step < self.cfg.trainer.steps
        ):
            await self.evaluate(self._eval_ctx or ctx, self._env, self.state.step)

    _unacked: list[Any]
    _syncer: Any  # trainer.weight_sync.WeightSyncer, for weight_sync: delta | delta_disk
    _eval_ctx: RolloutContext | None
    _env: Environment


def _progress(console: Any) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("[bold]train[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    return Progress(*columns, console=console)


def _write_resolved(cfg: RunConfig) -> None:
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    data = json.loads(cfg.model_dump_json())
    (cfg.run_dir / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def _resume(job: _Job, trainer: Any) -> dict[str, Any] | None:
    extra: dict[str, Any] | None = trainer.load_checkpoint(job.cfg.run_dir / "checkpoints")
    if extra is None:
        return None
    job.state.step = int(extra["step"])
    job.state.trained_ids = list(extra.get("trained_ids", []))
    if "rng" in extra:
        state = extra["rng"]
        job.rng.setstate((state[0], tuple(state[1]), state[2]))
    return extra


async def run_training(cfg: RunConfig, console: Any) -> dict[str, Any]:
    """Run (or resume) the job described by `cfg`; return the final summary."""
    from miles_env.engines import EngineConfig, build_engine
    from miles_env.harnesses import get_harness
    from miles_env.models import resolve_model
    from miles_env.queue import SqliteReplayQueue
    from miles_env.registry import load_environment
    from miles_env.stack import StackConfig, open_stack
    from miles_env.trainer.ranks import Leader, follow, torchrun_rank

    rank, world = torchrun_rank()
    if world > 1 and cfg.trainer.backend != "megatron":
        raise ConfigError(f"torchrun with {world} processes: only trainer.backend=megatron shards a model")
    if rank > 0:  # this rank only repeats rank 0's trainer calls (trainer/ranks.py)
        model = resolve_model(str(cfg.engine.get("model", "smollm2")))
        trainer = await anyio.to_thread.run_sync(build_trainer, cfg, model)
        return {"rank": rank, "trainer_calls": await anyio.to_thread.run_sync(follow, trainer)}
    _write_resolved(cfg)
    env = load_environment(cfg.env)
    train_tasks = _filter_tiers(env.tasks("train"), cfg.rollout.tiers)
    if not train_tasks:
        raise ConfigError(f"env={cfg.env!r} with rollout.tiers={cfg.rollout.tiers}: no train tasks")
    harness_opts = dict(cfg.harness)
    harness_name = harness_opts.pop("name", "builtin")
    harness = get_harness(harness_name, **harness_opts)
    eval_harness = harness
    if cfg.eval.temperature is not None:
        eval_harness = get_harness(harness_name, **{**harness_opts, "temperature": cfg.eval.temperature})
    engine_cfg = (
        EngineConfig(**{"seed": cfg.seed, **cfg.engine})
        if "seed" in EngineConfig.model_fields
        else (EngineConfig(**cfg.engine))
    )
    if engine_cfg.kind in ("vllm", "sglang") and engine_cfg.log_dir is None:  # server logs stay with the run
        engine_cfg = engine_cfg.model_copy(update={"log_dir": str(cfg.run_dir / "engine")})
    model_path = resolve_model(engine_cfg.model)
    sandbox_opts = dict(cfg.sandbox)
    provider = sandbox_opts.pop("provider", "local")

    job = _Job(cfg, RunLog(cfg.run_dir), console)
    job._unacked = []
    trainer = await anyio.to_thread.run_sync(build_trainer, cfg, model_path)
    if world > 1:
        trainer = Leader(trainer)
    queue_sync = SqliteReplayQueue(
        cfg.run_dir / "queue.db",
        group_size=cfg.rollout.group_size,
        max_pending_groups=2 * cfg.rollout.groups_per_step,
    )
    queue = queue_sync.aio
    resumed = _resume(job, trainer)
    if resumed is not None:
        acked, released = await queue.recover(job.state.trained_ids)
        console.print(
            f"resumed at step {job.state.step}: {acked} trained episodes acked, {released} returned to the queue"
        )
    engine = await build_engine(engine_cfg)
    try:
        if cfg.weight_sync.startswith("delta"):
            job._syncer = await anyio.to_thread.run_sync(_build_syncer, cfg, trainer, engine, job.state.step)
        if job.state.step > 0:  # the engine must serve the weights the trainer resumed with
            await job._sync_weights(trainer, engine)
        stack_cfg = StackConfig(
            engine=engine_cfg.model_dump(),
            tito=cfg.tito,
            sandbox=provider,
            sandbox_config=sandbox_opts,
            store_dir=cfg.run_dir / "sessions",
        )
        async with open_stack(stack_cfg, engine=engine) as stack:
            ctx = stack.rollout_context(env, harness, cfg.rollout.episode_timeout_s)
            job._eval_ctx = stack.rollout_context(env, eval_harness, cfg.rollout.episode_timeout_s)
            job._env = env
            before = None
            if cfg.eval.enabled and job.state.step == 0:
                before = await job.evaluate(job._eval_ctx, env, 0)
            runner = job.run_sync if cfg.mode == Mode.SYNC else job.run_fully_async
            with _progress(console) as progress:
                job.progress, job.console = progress, progress.console
                job.bar = progress.add_task("train", total=cfg.trainer.steps, completed=job.state.step)
                await runner(ctx, queue, trainer, engine, train_tasks)
            job.progress = None
            after = await job.evaluate(job._eval_ctx, env, job.state.step) if cfg.eval.enabled else None
    finally:
        if isinstance(trainer, Leader):
            await anyio.to_thread.run_sync(trainer.close)
        await engine.close()
        job.log.close()
        queue_sync.close()
    summary = {
        "steps": job.state.step,
        "eval_before": before,
        "eval_after": after,
        "run_dir": str(cfg.run_dir),
        "wall_s": time.time() - job.state.started,
    }
    write_json(cfg.run_dir / "summary.json", summary, default=float)
    return summary
