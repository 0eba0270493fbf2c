"""The driver's side of a scaled-out run: join Ray, share the engine, dispatch groups to workers.

Concept: `miles-env train` with `cluster.address` set keeps the trainer, the training loop, the
task rng and the weight sync, and replaces only where groups are rolled out: `cluster_rollouts`
yields a `ClusterRollouts`, the job's dispatch (job.py `_Job.produce`), which sends each chosen
task to one of `cluster.rollout_workers` `RolloutWorker` actors (worker.py), placed with Ray's
SPREAD strategy (and `worker_resources`, e.g. {"rollout": 1} on rollout nodes). The workers put
the episodes into the Redis queue themselves; the loop takes them from there as in one process.

The engine every worker reaches: the user's SGLang servers (`engine.kind=sglang` with url/urls),
attached to directly; any other engine (the embedded hf engine, a launched server bound to
loopback) is the driver's own, served to the workers by the embedded SGLang-compatible server
(engines/sglang_server.py) on this node's IP. Weight sync is unchanged: the driver updates its
one engine after each step, and the workers' clients see the new version in every response.

Eval runs on the driver, on its own stack, as in one process (the workers roll out train groups).

Faults: a worker that dies (its node lost) fails the groups it had in flight with a RayActorError;
each such task is re-run on the least busy living worker (at most `max_attempts` tries), so none
is lost. Episodes the dead worker had put stay in the queue; a group it left short of
`group_size` stays OPEN there and is never trained (counted: `queue stats` open groups). A group
the worker finished just before dying is re-run too: an extra group, never the same episode twice.
No worker left is a ClusterError. RUN_DIR/cluster.json records, per worker, its node, groups and
episodes, and the losses and re-dispatches.

Lifecycle: `async with cluster_rollouts(cfg, engine) as dispatch:` joins the cluster (ray.init),
starts the engine server if needed and the workers; on exit cancels what is in flight, closes and
kills the workers, writes cluster.json and leaves the cluster (the cluster itself keeps running).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio

from miles_env.cluster.worker import GroupReport, RolloutWorker, WorkerSpec
from miles_env.config import RunConfig
from miles_env.engines.base import Engine
from miles_env.engines.configs import SGLangEngineConfig
from miles_env.errors import ClusterError, ConfigError
from miles_env.jsonio import write_json
from miles_env.types import Task

__all__ = ["ClusterRollouts", "cluster_rollouts"]

log = logging.getLogger(__name__)

CLOSE_S = 60.0  # a worker's close (its sandboxes, its proxy) before it is killed anyway


@dataclass(slots=True)
class _Worker:
    name: str
    actor: Any  # ray.actor.ActorHandle of RolloutWorker
    node_id: str = ""
    alive: bool = True
    in_flight: int = 0
    groups: int = 0
    episodes: int = 0
    lost_error: str | None = None


@dataclass(slots=True)
class ClusterRollouts:
    """The job's dispatch: `await rollouts(tasks)` rolls one group of each task out on the workers."""

    workers: list[_Worker]
    max_attempts: int
    redispatched: int = 0  # tasks re-run after their worker died under them
    reports: list[GroupReport] = field(default_factory=list)

    async def __call__(self, tasks: Sequence[Task]) -> None:
        async with anyio.create_task_group() as tg:
            for task in tasks:
                tg.start_soon(self._run, task)

    def _pick(self) -> _Worker:
        living = [w for w in self.workers if w.alive]
        if not living:
            lost = "; ".join(f"{w.name}: {w.lost_error}" for w in self.workers)
            raise ClusterError(f"every rollout worker died ({lost})")
        return min(living, key=lambda w: w.in_flight)

    async def _run(self, task: Task) -> None:
        from ray.exceptions import RayActorError

        for attempt in range(self.max_attempts):
            worker = self._pick()
            worker.in_flight += 1
            try:
                report: GroupReport = await _call(worker.actor.run_group, task)
            except RayActorError as e:
                self._lose(worker, e)
                if attempt + 1 < self.max_attempts:
                    self.redispatched += 1
                continue
            finally:
                worker.in_flight -= 1
            worker.groups += 1
            worker.episodes += report.episodes
            self.reports.append(report)
            return
        raise ClusterError(f"task {task.id!r}: its worker died on each of {self.max_attempts} attempts")

    def _lose(self, worker: _Worker, error: Exception) -> None:
        if worker.alive:
            worker.alive = False
            worker.lost_error = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            log.warning(
                "rollout worker %s (node %s) lost: %s", worker.name, worker.node_id, worker.lost_error
            )

    def summary(self) -> dict[str, Any]:
        keys = ("name", "node_id", "alive", "groups", "episodes", "lost_error")
        workers = [{k: getattr(w, k) for k in keys} for w in self.workers]
        lost = sum(1 for w in self.workers if not w.alive)
        return {"workers": workers, "workers_lost": lost, "groups_redispatched": self.redispatched}


async def _call(method: Any, *args: Any) -> Any:
    """One actor call; cancelling the caller cancels the call on the worker (nothing is put then)."""
    import ray

    ref = method.remote(*args)
    try:
        return await ref
    except anyio.get_cancelled_exc_class():
        ray.cancel(ref)
        raise


async def _workers_engine(cfg: RunConfig, engine: Engine, stack: AsyncExitStack) -> SGLangEngineConfig:
    """The engine config each worker builds its client from (see the module docstring)."""
    import ray

    own = cfg.engine
    if isinstance(own, SGLangEngineConfig) and not own.launch and (own.url or own.urls):
        return own.model_copy(update={"router": "ring"})  # one router per worker would be one too many
    from miles_env.engines.sglang_server import running_server

    host = cfg.cluster.engine_host or ray.util.get_node_ip_address()
    url = await stack.enter_async_context(running_server(engine, host=host, port=0))
    log.info("serving the engine to the rollout workers at %s", url)
    return SGLangEngineConfig(url=url, model=own.model)


async def _start_workers(cfg: RunConfig, engine_cfg: SGLangEngineConfig) -> list[_Worker]:
    import ray

    c = cfg.cluster
    actor_cls = ray.remote(RolloutWorker).options(
        num_cpus=c.worker_cpus, resources=dict(c.worker_resources), scheduling_strategy="SPREAD",
        max_restarts=0, max_task_retries=0,
    )  # fmt: skip
    workers = []
    for i in range(c.rollout_workers):
        spec = WorkerSpec(name=f"worker-{i}", run=cfg, engine=engine_cfg)
        workers.append(_Worker(spec.name, actor_cls.remote(spec.model_dump_json())))
    started = [w.actor.start.remote() for w in workers]  # concurrently; a failed start fails the run
    try:
        with anyio.fail_after(c.start_timeout_s):
            for w, ref in zip(workers, started, strict=True):
                w.node_id = await ref
    except TimeoutError:
        for w in workers:
            ray.kill(w.actor, no_restart=True)
        need = {"CPU": c.worker_cpus, **c.worker_resources}
        raise ClusterError(
            f"cluster.rollout_workers={c.rollout_workers}: not all started within "
            f"cluster.start_timeout_s={c.start_timeout_s:g}; does the cluster offer {need} to each?"
        ) from None
    return workers


async def _stop_workers(workers: list[_Worker]) -> None:
    import ray

    for w in workers:
        if w.alive:
            with anyio.move_on_after(CLOSE_S):
                try:
                    await w.actor.close.remote()
                except ray.exceptions.RayActorError:
                    pass
        ray.kill(w.actor, no_restart=True)


@asynccontextmanager
async def cluster_rollouts(cfg: RunConfig, engine: Engine) -> AsyncIterator[ClusterRollouts]:
    """Join the Ray cluster at `cfg.cluster.address` and run the rollouts there (module docstring)."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError(
            f"cluster.address: Ray is not installed ({e}); pip install 'miles-env[scale]'"
        ) from e

    try:
        ray.init(address=cfg.cluster.address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterError(
            f"cluster.address={cfg.cluster.address!r}: cannot join the Ray cluster: {e}"
        ) from e
    cfg = cfg.model_copy(update={"run_dir": cfg.run_dir.resolve()})  # the workers' cwd is not ours
    workers: list[_Worker] = []
    try:
        async with AsyncExitStack() as stack:
            engine_cfg = await _workers_engine(cfg, engine, stack)
            workers = await _start_workers(cfg, engine_cfg)
            rollouts = ClusterRollouts(workers, cfg.cluster.max_attempts)
            try:
                yield rollouts
            finally:
                write_json(cfg.run_dir / "cluster.json", rollouts.summary())
                with anyio.CancelScope(shield=True):
                    await _stop_workers(workers)
                workers = []
    finally:
        for w in workers:  # a start that failed half way
            ray.kill(w.actor, no_restart=True)
        ray.shutdown()
