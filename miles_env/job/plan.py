"""What the main job is made of, resolved from the run config before the loop starts.

`plan_job` turns a RunConfig into a `JobPlan` (environment, train tasks, harnesses, engine and
stack configs, model path) without building anything heavy; `build_job_trainer` builds the trainer
(in this process, or as a Ray actor on a trainer node); `job_engine` the engine (in this process,
or a client of engine actors Ray placed); `rollout_dispatch` where groups are rolled out (here, or
on Ray rollout workers); `loop_config` the TrainLoop's settings; `write_resolved` RUN_DIR/config.yaml
(the resolved config with the environment's distribution). run.py wires these together.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from miles_env.config import Mode, RunConfig
from miles_env.engines.base import Engine
from miles_env.environment import Environment
from miles_env.errors import ConfigError
from miles_env.evals.base import filter_tiers
from miles_env.harness import Harness
from miles_env.opd import trainer_options
from miles_env.provenance import env_distribution
from miles_env.trainer.loop import LoopConfig, TrainerBackend
from miles_env.types import POLICY_ENDS, EpisodeEnd, Task

if TYPE_CHECKING:
    from miles_env.engines import EngineConfig
    from miles_env.stack import StackConfig

__all__ = [
    "LEASE_S",
    "Dispatch",
    "JobPlan",
    "build_job_trainer",
    "job_engine",
    "loop_config",
    "plan_job",
    "policy_ends",
    "rollout_dispatch",
    "write_resolved",
]

# where a scaled-out job sends the tasks it chose (cluster/driver.py); None: rolled out in this process
Dispatch = Callable[[Sequence[Task]], Awaitable[None]]

LEASE_S = 24 * 3600.0  # acked after the checkpoint; a restart recovers leases, not the lease timer


def policy_ends(cfg: RunConfig) -> tuple[EpisodeEnd, ...]:
    """The end classes that train (`trainer.policy_ends`, a TrainerConfig field: the backend checks
    it at build; default types.POLICY_ENDS): the job re-rolls the rest."""
    given = cfg.trainer.backend_options.get("policy_ends")
    return tuple(EpisodeEnd(e) for e in (sorted(POLICY_ENDS) if given is None else given))


def build_job_trainer(cfg: RunConfig, model_path: Path) -> TrainerBackend:
    from miles_env.trainer.build import build_trainer

    options = {
        "seed": cfg.seed,
        "keep_checkpoints": cfg.trainer.keep_checkpoints,
        **cfg.trainer.backend_options,
        **trainer_options(cfg.opd),  # algorithm=opd: per-token teacher advantages (miles_env/opd.py)
    }
    if options.get("lr_schedule") == "cosine":  # decays over the run unless told (trainer/lr_schedule.py)
        options.setdefault("lr_decay_steps", cfg.trainer.steps)
    if cfg.cluster.address is not None and cfg.cluster.trainer is not None:  # an actor on a trainer node
        from miles_env.cluster.trainer import remote_trainer

        return remote_trainer(cfg, model_path, options)
    return build_trainer(cfg.trainer.backend, model_path, options)


@dataclass(frozen=True, slots=True)
class JobPlan:
    """What the run config resolves to before anything heavy is built."""

    env: Environment
    train_tasks: list[Task]
    harness: Harness
    eval_harness: Harness
    engine_cfg: EngineConfig
    model_path: Path
    stack_cfg: StackConfig


def write_resolved(cfg: RunConfig, env: Environment) -> None:
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    data = json.loads(cfg.model_copy(update={"env_dist": env_distribution(env)}).model_dump_json())
    (cfg.run_dir / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def loop_config(cfg: RunConfig) -> LoopConfig:
    fully_async = cfg.mode != Mode.SYNC
    workers = cfg.cluster.rollout_workers if cfg.cluster.address is not None else 1
    return LoopConfig(
        steps=cfg.trainer.steps,
        groups_per_step=cfg.rollout.groups_per_step,
        ckpt_dir=cfg.run_dir / "checkpoints",
        ckpt_every=cfg.trainer.checkpoint_every,
        max_staleness=cfg.rollout.max_staleness,
        stale_in_baseline=cfg.rollout.stale_in_baseline,
        producers=workers * max(1, cfg.rollout.concurrency // cfg.rollout.group_size) if fully_async else 0,
        eval_every=cfg.eval.every if cfg.eval.enabled else 0,
        lease_s=LEASE_S,
        poll_s=0.2,
        dynamic_sampling=cfg.rollout.dynamic_sampling,
        max_sampling_factor=cfg.rollout.max_sampling_factor,
        policy_ends=policy_ends(cfg),
    )


def plan_job(cfg: RunConfig) -> JobPlan:
    """Environment, harnesses, engine and stack configs from the run config (nothing heavy built)."""
    from miles_env.engines import ServerEngineConfig
    from miles_env.harnesses import build_harness
    from miles_env.models import resolve_model
    from miles_env.registry import load_environment
    from miles_env.stack import StackConfig, run_fleet

    env = load_environment(cfg.env)
    train_tasks = filter_tiers(env.tasks("train"), cfg.rollout.tiers)
    if not train_tasks:
        raise ConfigError(f"env={cfg.env!r} with rollout.tiers={cfg.rollout.tiers}: no train tasks")
    harness = build_harness(cfg.harness)
    eval_harness = harness
    if cfg.eval.temperature is not None:  # RunConfig checked that this harness has a temperature
        eval_harness = build_harness(cfg.harness.model_copy(update={"temperature": cfg.eval.temperature}))
    engine_cfg = cfg.engine
    if "seed" in type(engine_cfg).model_fields and "seed" not in engine_cfg.model_fields_set:
        engine_cfg = engine_cfg.model_copy(update={"seed": cfg.seed})  # the run's seed, unless its own
    if isinstance(engine_cfg, ServerEngineConfig) and engine_cfg.log_dir is None:  # logs stay with the run
        engine_cfg = engine_cfg.model_copy(update={"log_dir": str(cfg.run_dir / "engine")})
    model_path = resolve_model(engine_cfg.model)
    stack_cfg = StackConfig(
        engine=engine_cfg, tito=cfg.tito, sandbox=cfg.sandbox, store_dir=cfg.run_dir / "sessions",
        fleet=run_fleet(cfg), cost=cfg.cost,
    )  # fmt: skip
    return JobPlan(env, train_tasks, harness, eval_harness, engine_cfg, model_path, stack_cfg)


def rollout_dispatch(cfg: RunConfig, engine: Engine) -> AbstractAsyncContextManager[Dispatch | None]:
    """With `cluster.address`, Ray actors roll the groups out (cluster/driver.py); else nothing."""
    if cfg.cluster.address is None:
        return nullcontext(None)
    from miles_env.cluster.driver import cluster_rollouts

    return cluster_rollouts(cfg, engine)


async def job_engine(cfg: RunConfig, plan: JobPlan) -> Engine:
    """The job's engine: with `cluster.engines`, a client of engine actors Ray placed
    (cluster/engines.py); else built in this process."""
    if cfg.cluster.address is not None and cfg.cluster.engines is not None:
        from miles_env.cluster.engines import placed_engines

        return await placed_engines(cfg, plan.engine_cfg, plan.model_path)
    from miles_env.engines import build_engine

    return await build_engine(plan.engine_cfg)
