"""The driver's side of a scaled-out run: join Ray, share the engine, dispatch groups to workers.

Concept: `miles-env train` with `cluster.address` set keeps the trainer, the training loop, the
task rng and the weight sync, and replaces only where groups are rolled out: `cluster_rollouts`
yields a `ClusterRollouts`, the job's dispatch (job/run.py `_Job.produce`), which sends each chosen
task to one of `cluster.rollout_workers` `RolloutWorker` actors (worker.py), placed with Ray's
SPREAD strategy (and `worker_resources`, e.g. {"rollout": 1} on rollout nodes). The workers put
the episodes into the Redis queue themselves; the loop takes them from there as in one process.

The engine every worker reaches: the engines Ray placed (`cluster.engines`, engines.py) or the
user's SGLang servers (`engine.kind=sglang` with url/urls), attached to directly; any other engine (the embedded hf engine, a launched server bound to
loopback) is the driver's own, served to the workers by the embedded SGLang-compatible server
(engines/sglang_server.py) on this node's IP. Weight sync is unchanged: the driver updates its
one engine after each step, and the workers' clients see the new version in every response.

Eval runs on the driver, on its own stack, as in one process (the workers roll out train groups).

Faults: a worker that dies (its process killed, its node lost) fails the groups it had in flight
with a RayActorError; each such task is re-run on the least busy living worker (at most
`max_attempts` tries), so none is lost. With `replace_workers` (the default) the first task that
sees the death has a new worker (`worker-{n}`) placed in the background, where Ray finds room
(the dead one's resources are free again, or another node's), and retries at once on the living
ones; tasks that find no worker alive wait for a replacement under way. One that cannot be placed
within `start_timeout_s` is given up (logged), the run goes on with the others. Episodes the dead worker had put stay in the queue; a
group it left short of `group_size` stays OPEN there and is never trained (counted: `queue stats`
open groups). A group the worker finished just before dying is re-run too: an extra group, never
the same episode twice. No worker left (none alive, none being started) is a ClusterError.
RUN_DIR/cluster.json records, per worker, its node, groups, episodes and whom it replaced, and
the losses, replacements and re-dispatches (and the placed engines, engines.py).
Placed engines (`cluster.engines.replace`): `watch_engines` (engine_faults.py) runs in the
background; once an engine is found dead, and again once its replacement has joined,
`set_engine_urls` hands the live URLs to every living worker (`RolloutWorker.set_engine_urls`), and a worker started later is told them as soon
as it is placed.

Lifecycle: `async with cluster_rollouts(cfg, engine) as dispatch:` joins the cluster (ray.init),
starts the engine server if needed and the workers; on exit cancels what is in flight, closes and
kills the workers, writes cluster.json and leaves the cluster (the cluster itself keeps running).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskGroup

from miles_env.cluster import session
from miles_env.cluster.worker import GroupReport, RolloutWorker, WorkerSpec
from miles_env.config import RunConfig
from miles_env.engines.base import Engine
from miles_env.engines.configs import SGLangEngineConfig
from miles_env.errors import ClusterError
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
    replaces: str | None = None  # the dead worker this one was started for


Spawn = Callable[[str], Awaitable[_Worker]]  # start one more worker under this name (placed, open)


@dataclass(slots=True)
class ClusterRollouts:
    """The job's dispatch: `await rollouts(tasks)` rolls one group of each task out on the workers."""

    workers: list[_Worker]
    max_attempts: int
    spawn: Spawn | None = None  # None: a dead worker is not replaced
    background: TaskGroup | None = None  # where replacements are placed, apart from any dispatch
    redispatched: int = 0  # tasks re-run after their worker died under them
    replaced: int = 0  # workers started for dead ones
    reports: list[GroupReport] = field(default_factory=list)
    engine_urls: list[str] | None = None  # the placed engines' live URLs once one was replaced
    _requested: int = 0  # replacements asked for (they name worker-{n})
    _starting: int = 0  # replacements under way
    _changed: anyio.Event = field(default_factory=anyio.Event)  # set when one of them is done

    async def __call__(self, tasks: Sequence[Task]) -> None:
        async with anyio.create_task_group() as tg:
            for task in tasks:
                tg.start_soon(self._run, task)

    async def _pick(self) -> _Worker:
        while True:
            living = [w for w in self.workers if w.alive]
            if living:
                return min(living, key=lambda w: w.in_flight)
            if not self._starting:
                lost = "; ".join(f"{w.name}: {w.lost_error}" for w in self.workers)
                raise ClusterError(f"every rollout worker died ({lost})")
            await self._changed.wait()  # a replacement is being placed

    async def _run(self, task: Task) -> None:
        from ray.exceptions import RayActorError

        for attempt in range(self.max_attempts):
            worker = await self._pick()
            worker.in_flight += 1
            try:
                report: GroupReport = await _call(worker.actor.run_group, task)
            except RayActorError as e:
                if self._lose(worker, e):
                    self._replace(worker)
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

    def _lose(self, worker: _Worker, error: Exception) -> bool:
        """Mark `worker` dead; True for the first caller that saw it die."""
        if not worker.alive:
            return False
        worker.alive = False
        worker.lost_error = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        log.warning("rollout worker %s (node %s) lost: %s", worker.name, worker.node_id, worker.lost_error)
        return True

    def _replace(self, dead: _Worker) -> None:
        """Start a worker for `dead` in the background (the task goes on on the living ones); one
        that cannot be placed within `start_timeout_s` leaves the run to the others."""
        if self.spawn is None or self.background is None:
            return
        first = sum(1 for w in self.workers if w.replaces is None)  # the workers started at first
        name = f"worker-{first + self._requested}"
        self._requested += 1
        self._starting += 1
        self.background.start_soon(self._replacement, dead, name)

    async def _replacement(self, dead: _Worker, name: str) -> None:
        assert self.spawn is not None
        try:
            new = await self.spawn(name)
        except Exception as e:  # recorded; the living workers carry on
            log.warning("rollout worker %s not replaced: %s", dead.name, e)
        else:
            new.replaces = dead.name
            self.workers.append(new)
            self.replaced += 1
            log.warning("rollout worker %s replaced by %s (node %s)", dead.name, new.name, new.node_id)
            if self.engine_urls is not None:  # an engine replaced while it started: the list now
                await _tell(new, self.engine_urls)
        finally:
            self._starting -= 1
            self._changed.set()
            self._changed = anyio.Event()

    async def set_engine_urls(self, urls: list[str]) -> None:
        """A placed engine was replaced (engine_faults.py): every living worker reaches `urls`."""
        self.engine_urls = list(urls)
        async with anyio.create_task_group() as tg:
            for w in self.workers:
                if w.alive:
                    tg.start_soon(_tell, w, self.engine_urls)

    def summary(self) -> dict[str, Any]:
        keys = ("name", "node_id", "alive", "groups", "episodes", "lost_error", "replaces")
        workers = [{k: getattr(w, k) for k in keys} for w in self.workers]
        lost = sum(1 for w in self.workers if not w.alive)
        return {
            "workers": workers, "workers_lost": lost, "workers_replaced": self.replaced,
            "groups_redispatched": self.redispatched,
        }  # fmt: skip


async def _tell(worker: _Worker, urls: list[str]) -> None:
    """Hand `urls` to one worker; a dead one is the dispatch's to find (RayActorError there), and
    a worker that could not take them keeps its ring (its client drops a dead engine itself)."""
    from ray.exceptions import RayActorError, RayError

    try:
        await worker.actor.set_engine_urls.remote(urls)
    except RayActorError:
        pass
    except RayError as e:
        log.warning("rollout worker %s: engine URLs not updated: %s", worker.name, str(e).splitlines()[0])


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

    from miles_env.cluster.engines import PlacedEngines

    own = cfg.engine
    if isinstance(engine, PlacedEngines):  # the engine actors, each reached directly
        return SGLangEngineConfig(urls=engine.engine_urls, model=own.model)
    if isinstance(own, SGLangEngineConfig) and not own.launch and (own.url or own.urls):
        return own.model_copy(update={"router": "ring"})  # one router per worker would be one too many
    from miles_env.engines.sglang_server import running_server

    host = cfg.cluster.engine_host or ray.util.get_node_ip_address()
    url = await stack.enter_async_context(running_server(engine, host=host, port=0))
    log.info("serving the engine to the rollout workers at %s", url)
    return SGLangEngineConfig(url=url, model=own.model)


def _spawner(cfg: RunConfig, engine_cfg: SGLangEngineConfig) -> Spawn:
    """Start one worker actor (placed by SPREAD and `worker_resources`) and wait for its stack."""
    import ray

    c = cfg.cluster
    actor_cls = ray.remote(RolloutWorker).options(
        num_cpus=c.worker_cpus, resources=dict(c.worker_resources), scheduling_strategy="SPREAD",
        max_restarts=0, max_task_retries=0,
    )  # fmt: skip

    async def spawn(name: str) -> _Worker:
        spec = WorkerSpec(name=name, run=cfg, engine=engine_cfg)
        worker = _Worker(name, actor_cls.remote(spec.model_dump_json()))
        try:
            with anyio.fail_after(c.start_timeout_s):
                worker.node_id = await worker.actor.start.remote()
        except BaseException as e:
            ray.kill(worker.actor, no_restart=True)
            if isinstance(e, TimeoutError):
                need = {"CPU": c.worker_cpus, **c.worker_resources}
                raise ClusterError(
                    f"cluster.rollout_workers: {name} not started within "
                    f"cluster.start_timeout_s={c.start_timeout_s:g}; does the cluster offer {need}?"
                ) from None
            raise
        return worker

    return spawn


async def _start_workers(cfg: RunConfig, spawn: Spawn) -> list[_Worker]:
    """The first `rollout_workers`, started concurrently; one that fails fails the run."""
    c = cfg.cluster
    workers: list[_Worker | None] = [None] * c.rollout_workers
    failures: list[BaseException] = []

    async def one(i: int) -> None:
        try:
            workers[i] = await spawn(f"worker-{i}")
        except Exception as e:
            failures.append(e)

    async with anyio.create_task_group() as tg:
        for i in range(c.rollout_workers):
            tg.start_soon(one, i)
    started = [w for w in workers if w is not None]
    if failures:
        await _stop_workers(started)
        if isinstance(failures[0], ClusterError):
            need = {"CPU": c.worker_cpus, **c.worker_resources}
            raise ClusterError(
                f"cluster.rollout_workers={c.rollout_workers}: not all started within "
                f"cluster.start_timeout_s={c.start_timeout_s:g}; does the cluster offer {need} to each?"
            ) from None
        raise failures[0]
    return started


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


async def _finish(cfg: RunConfig, engine: Engine, rollouts: ClusterRollouts) -> None:
    """Write RUN_DIR/cluster.json (workers, and the placed engines' versions), stop the workers."""
    from miles_env.cluster.engines import PlacedEngines

    summary = rollouts.summary()
    if isinstance(engine, PlacedEngines):
        summary["engines"] = await engine.summary()
        summary["engines_replaced"] = sum(1 for e in summary["engines"] if e["replaces"] is not None)
    write_json(cfg.run_dir / "cluster.json", summary)
    await _stop_workers(rollouts.workers)


@asynccontextmanager
async def cluster_rollouts(cfg: RunConfig, engine: Engine) -> AsyncIterator[ClusterRollouts]:
    """Join the Ray cluster at `cfg.cluster.address` and run the rollouts there (module docstring)."""
    from miles_env.cluster.engines import PlacedEngines

    assert cfg.cluster.address is not None
    joined = session.join(cfg.cluster.address)
    cfg = cfg.model_copy(update={"run_dir": cfg.run_dir.resolve()})  # the workers' cwd is not ours
    try:
        async with AsyncExitStack() as stack:
            engine_cfg = await _workers_engine(cfg, engine, stack)
            spawn = _spawner(cfg, engine_cfg)
            workers = await _start_workers(cfg, spawn)
            rollouts = ClusterRollouts(workers, cfg.cluster.max_attempts)
            try:
                async with anyio.create_task_group() as background:
                    if cfg.cluster.replace_workers:
                        rollouts.spawn, rollouts.background = spawn, background
                    if isinstance(engine, PlacedEngines) and engine.replaces:
                        from miles_env.cluster.engine_faults import watch_engines

                        background.start_soon(watch_engines, engine, rollouts.set_engine_urls)
                    try:
                        yield rollouts
                    finally:
                        background.cancel_scope.cancel()  # a replacement still being placed
            finally:
                with anyio.CancelScope(shield=True):
                    await _finish(cfg, engine, rollouts)
    finally:
        session.leave(joined)
