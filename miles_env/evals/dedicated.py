"""`eval.mode: dedicated`: eval episodes on an engine of their own, synced only at eval points.

Concept: the evaluator opens a second stack (engine + TITO proxy, sessions journaled under
RUN_DIR/eval_sessions) from `eval.engine` (default: the run's engine config; model and other
unset fields are the run's model), and runs the eval split there with the rollout context's
harness, sandboxes, timeouts and limits. At each eval point, in line, the trainer's weights of
that step go to the eval engine (in process for an engine in this process, else an HF export
under RUN_DIR/eval_weights), so its weight version changes only there and equals the step it
evaluates; the rollout engine never serves an eval episode. The episodes then run in line in
sync mode, in the evaluator's own task in fully_async mode (training and rollouts go on); an eval
point that finds the previous eval still running waits for it first (only the trainer waits).
Rows: `eval` under the step evaluated, with eval_weight_version, eval_syncs and eval_sync_s.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from dataclasses import replace
from functools import partial

import anyio
import anyio.to_thread

from miles_env.engines.base import Engine, InProcessWeights
from miles_env.engines.configs import EngineConfig, ServerEngineConfig, SGLangEngineConfig
from miles_env.errors import ConfigError
from miles_env.evals.base import EvalSetup, Evaluator, Metrics, run_eval_episodes
from miles_env.rollout import RolloutContext

__all__ = ["DedicatedEval", "eval_engine_config"]


def eval_engine_config(setup: EvalSetup) -> EngineConfig:
    """`eval.engine` with the run's model unless it names one; else a copy of the run's engine,
    which must start its own server (an attached server is the rollout engine itself)."""
    run, own = setup.engine_cfg, setup.cfg.eval.engine
    if own is not None:
        cfg = own if "model" in own.model_fields_set else own.model_copy(update={"model": run.model})
    elif isinstance(run, ServerEngineConfig):
        urls = ([run.url] if run.url else []) + (
            list(run.urls) if isinstance(run, SGLangEngineConfig) else []
        )
        if urls and not (isinstance(run, SGLangEngineConfig) and run.launch):
            raise ConfigError(
                "eval.engine: the run's engine is attached to a server; a dedicated eval needs its own"
            )
        cfg = run
    else:
        cfg = run
    if isinstance(cfg, ServerEngineConfig):
        cfg = cfg.model_copy(update={"log_dir": str(setup.cfg.run_dir / "eval_engine")})
    return cfg


class DedicatedEval(Evaluator):
    def __init__(self, setup: EvalSetup) -> None:
        super().__init__(setup)
        self.engine_cfg = eval_engine_config(setup)  # a bad eval.engine fails before anything starts
        self.background = setup.cfg.mode != "sync"
        self.syncs = 0  # weight updates the eval engine took
        self._engine: Engine | None = None
        self._ctx: RolloutContext | None = None

    async def open(self, stack: AsyncExitStack) -> None:
        from miles_env.stack import StackConfig, open_stack

        cfg = self.setup.cfg
        stack_cfg = StackConfig(
            engine=self.engine_cfg,
            tito=cfg.tito,
            sandbox=cfg.sandbox,
            store_dir=cfg.run_dir / "eval_sessions",
            cost=cfg.cost,  # its episodes are priced by the run's table (they count toward its budget)
        )
        own = await stack.enter_async_context(open_stack(stack_cfg))
        self._engine = own.engine
        # the rollout context's harness, sandboxes, timeouts and limits; this stack's proxy and engine
        self._ctx = replace(self.setup.context, proxy=own.proxy, proxy_url=own.proxy_url)

    async def evaluate(self, step: int) -> None:
        await self.drain()  # one eval at a time, each on the weights of its own step
        try:
            synced = await self._sync(step)
        except Exception as e:  # recorded: the eval engine refused the weights; training goes on
            self.fail(step, e)
            return
        if self._ctx is None:
            raise RuntimeError("DedicatedEval.evaluate outside `async with`")
        work = partial(run_eval_episodes, self.setup, self._ctx, step, synced)
        if self.background:
            self.in_background(step, work)
        else:
            await self.record(step, work)

    async def _sync(self, step: int) -> Metrics:
        """The trainer's weights of `step` into the eval engine, unless it serves them already."""
        engine = self._engine
        if engine is None:
            raise RuntimeError("DedicatedEval.evaluate outside `async with`")
        t0 = time.perf_counter()
        if (await engine.info()).weight_version != step:
            trainer = self.setup.trainer
            if isinstance(engine, InProcessWeights):
                state = await anyio.to_thread.run_sync(trainer.state_dict)
                await engine.update_weights(state, weight_version=step)
            else:
                path = await anyio.to_thread.run_sync(
                    trainer.export_weights, self.setup.cfg.run_dir / "eval_weights"
                )
                await engine.update_weights_from_disk(path, weight_version=step)
            self.syncs += 1
        return {
            "eval_weight_version": float((await engine.info()).weight_version),
            "eval_syncs": float(self.syncs),
            "eval_sync_s": time.perf_counter() - t0,
        }
