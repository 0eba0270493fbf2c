"""`RolloutWorker`: a Ray actor that runs GRPO groups on its node and puts them into the shared queue.

Concept: each worker opens its own rollout stack (`open_stack`: a TITO proxy on its loopback, its
own sandbox provider) over an `SGLangEngine` client of the engine every node reaches (the one the
driver serves, or the user's SGLang servers), and its own client of the run's Redis queue. The
driver picks the tasks (its rng, so a resume is deterministic) and calls `run_group(task)`; the
worker rolls the group out (`rollout.run_group`), stamps each episode's metadata with its node id
and name, and `put`s the episodes itself (back-pressure waits here, on the worker). Its proxy
journals under RUN_DIR/sessions/<name>, so `miles-env tito audit` checks each worker's store.

Invariant: a group is put only once all its episodes exist, episode by episode; a worker that dies
mid-put leaves its group OPEN in the queue (short of `group_size`), which `take` never returns, so
it is never trained half (it shows as an open group in `queue stats`). The driver re-runs the task
elsewhere (driver.py). At most `rollout.concurrency` episodes run at once on one worker.

Lifecycle: Ray runs the actor's async methods on one asyncio loop, so the stack is held open by a
task of that loop (`_hold`) between `start()` and `close()`: a context entered in one actor call
could not be exited from another.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict

from miles_env.config import RunConfig
from miles_env.engines.configs import SGLangEngineConfig
from miles_env.queue.aio import AsyncReplayQueue
from miles_env.rollout import RolloutContext, run_group
from miles_env.types import Task

__all__ = ["WorkerSpec", "GroupReport", "RolloutWorker", "worker_store"]


class WorkerSpec(BaseModel):
    """What a worker is built from; sent to the actor as JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    run: RunConfig  # the job's config, run_dir absolute
    engine: SGLangEngineConfig  # a client of the engine the workers share


class GroupReport(BaseModel):
    """What a worker returns for one group it rolled out and put."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    worker: str
    node_id: str
    group_id: str
    episodes: int
    put: int  # episodes the queue took (a retried put of a known id is a no-op)


def worker_store(run_dir: Path, name: str) -> Path:
    """Where worker `name` journals its proxy sessions (audit each with `miles-env tito audit`)."""
    return run_dir / "sessions" / name


class RolloutWorker:
    """The actor's class (wrapped with `ray.remote` by the driver, so importing it needs no Ray)."""

    def __init__(self, spec_json: str) -> None:
        self.spec = WorkerSpec.model_validate_json(spec_json)
        self.name = self.spec.name
        self.node_id = ""
        self._ctx: RolloutContext | None = None
        self._queue: AsyncReplayQueue | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._holder: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._running: set[asyncio.Task[Any]] = set()  # run_group calls, cancelled by close()
        self._engine: Any = None  # the stack's engine client (an SGLangEngine)

    async def start(self) -> str:
        """Open the stack and the queue; return this worker's Ray node id."""
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self._holder = asyncio.get_running_loop().create_task(self._hold())
        await self._ready.wait()
        if self._failure is not None:
            raise self._failure
        return self.node_id

    async def _hold(self) -> None:
        from miles_env.harnesses import build_harness
        from miles_env.queue.config import build_queue
        from miles_env.registry import load_environment
        from miles_env.stack import StackConfig, open_stack, run_fleet

        cfg = self.spec.run
        queue_sync = None
        try:
            env = load_environment(cfg.env)
            harness = build_harness(cfg.harness)
            stack_cfg = StackConfig(
                engine=self.spec.engine, tito=cfg.tito, sandbox=cfg.sandbox,
                store_dir=worker_store(cfg.run_dir, self.name), fleet=run_fleet(cfg), cost=cfg.cost,
            )  # fmt: skip
            queue_sync = build_queue(
                cfg.queue, cfg.run_dir, group_size=cfg.rollout.group_size,
                max_pending_groups=2 * cfg.rollout.groups_per_step,
            )  # fmt: skip
            async with open_stack(stack_cfg) as stack:
                self._engine = stack.engine
                self._ctx = replace(
                    stack.rollout_context(env, harness, cfg.rollout.episode_timeout_s, cfg.rollout.limits),
                    guards=cfg.guards,
                )
                self._queue = AsyncReplayQueue(queue_sync)
                self._limiter = anyio.CapacityLimiter(
                    max(1, cfg.rollout.concurrency // cfg.rollout.group_size)
                )
                self._ready.set()
                await self._stop.wait()
        except Exception as e:  # a failed start (or close) is start()'s error, on the driver
            self._failure = e
            self._ready.set()
        finally:
            self._ctx = self._queue = self._engine = None
            if queue_sync is not None:
                queue_sync.close()

    async def run_group(self, task: Task) -> GroupReport:
        """Roll out one group of `task` and put its episodes into the queue."""
        if self._ctx is None or self._queue is None or self._limiter is None:
            raise RuntimeError(f"rollout worker {self.name}: not started, or closed")
        ctx, queue, limiter = self._ctx, self._queue, self._limiter
        current = asyncio.current_task()
        assert current is not None
        self._running.add(current)
        try:
            return await self._group(ctx, queue, limiter, task)
        finally:
            self._running.discard(current)

    async def _group(
        self, ctx: RolloutContext, queue: AsyncReplayQueue, limiter: anyio.CapacityLimiter, task: Task
    ) -> GroupReport:
        async with limiter:
            group = await run_group(ctx, task, self.spec.run.rollout.group_size)
        put = 0
        for ep in group:
            where: dict[str, Any] = {"node_id": self.node_id, "worker": self.name}
            put += await queue.put(ep.model_copy(update={"metadata": {**ep.metadata, "cluster": where}}))
        group_id = group[0].group_id if group else ""
        return GroupReport(worker=self.name, node_id=self.node_id, group_id=group_id,
                           episodes=len(group), put=put)  # fmt: skip

    async def set_engine_urls(self, urls: list[str]) -> None:
        """The engines to reach from now on (a placed engine was replaced: cluster/engine_faults.py);
        turns in flight finish where they are, a session's next turn follows the new ring."""
        from miles_env.engines.sglang import SGLangEngine

        if isinstance(self._engine, SGLangEngine):
            self._engine.set_urls(urls)

    async def close(self) -> None:
        """Cancel the groups in flight (nothing more is put), close the stack and the queue client."""
        for running in list(self._running):
            running.cancel()
        self._stop.set()
        if self._holder is not None:
            with contextlib.suppress(Exception):
                await self._holder
