"""Injected infrastructure faults, for the fault-injected runs and benchmarks (`faults:` in a run config).

Concept: a run's faults wrap two of its real parts, so every other part meets them as it would
meet the real failures. `FaultyProvider` fails a share of sandbox creations with a SandboxError
(the episode is SANDBOX_START), drawn from a seeded rng: the same seed fails the same creations;
a failing creation first creates and closes the real sandbox, so it costs what a creation that
fails late (a container that never becomes ready) costs.
`FaultyEngine` (the proxy's engine, never the trainer's) restarts: at its `restart_at`-th
generate call, every call in flight and every call for `down_s` after fail with EngineError, as
a restarted server's would (ENGINE_ERROR when the harness gives up); the calls in `stall_at` are
held `stall_s` before they are sampled, so a harness with a shorter request timeout gives up and
retries (the held sampling is then never delivered: it never trains). Its calls are counted over
every session the proxy serves: under `eval.mode: shared` the in-run evals' calls count and break
too (the step-0 eval takes the first ones), so a run that wants a clean eval curve under engine
faults uses `eval.mode: dedicated` (its own engine, never wrapped); sandbox faults hit training
rollouts only. Off by default; a run without `faults` has none of this in its path.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
from pydantic import BaseModel, ConfigDict, Field

from miles_env.engines.base import Engine, EngineInfo, Generation, SamplingParams
from miles_env.errors import EngineError, SandboxError
from miles_env.sandbox import Sandbox, SandboxProvider
from miles_env.types import SandboxSpec

__all__ = ["FaultsConfig", "FaultyEngine", "FaultyProvider"]


class FaultsConfig(BaseModel):
    """What to break, and how often (all off by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    sandbox_create: float = Field(0.0, ge=0, le=1, description="share of sandbox creations that fail")
    restart_at: list[int] = Field(
        default_factory=list, description="engine generate calls (1-based) that restart it"
    )
    down_s: float = Field(1.0, ge=0, description="seconds a restarted engine refuses calls")
    stall_at: list[int] = Field(default_factory=list, description="engine calls (1-based) held stall_s")
    stall_s: float = Field(0.0, ge=0, description="how long a held call waits before it is sampled")

    @property
    def engine(self) -> bool:
        return bool(self.restart_at) or (bool(self.stall_at) and self.stall_s > 0)


class FaultyProvider:
    """A provider whose `create` fails with probability `rate` (seeded), else the inner one's."""

    def __init__(self, inner: SandboxProvider, rate: float, seed: int = 0) -> None:
        self.inner, self.rate, self.name = inner, rate, inner.name
        self.rng = random.Random(seed)
        self.failed = self.created = 0

    async def create(self, spec: SandboxSpec) -> Sandbox:
        self.created += 1
        fail = self.rng.random() < self.rate
        sandbox = await self.inner.create(spec)
        if not fail:
            return sandbox
        self.failed += 1
        await sandbox.close()
        raise SandboxError(f"injected fault: sandbox creation {self.created} failed")


class FaultyEngine:
    """The proxy's view of an engine that restarts and stalls as `config` says (module docstring)."""

    def __init__(self, inner: Engine, config: FaultsConfig) -> None:
        self.inner, self.config = inner, config
        self.calls = 0
        self.epoch = 0  # bumped by each restart: a call that began in an older epoch fails
        self.down_until = 0.0
        self.failed = 0

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Generation:
        self.calls += 1
        n, cfg = self.calls, self.config
        if n in cfg.restart_at:
            self.epoch += 1
            self.down_until = time.monotonic() + cfg.down_s
        if time.monotonic() < self.down_until:
            self.failed += 1
            raise EngineError(f"injected fault: engine restarting (call {n})")
        epoch = self.epoch
        if n in cfg.stall_at:
            await anyio.sleep(cfg.stall_s)
        gen = await self.inner.generate(input_ids, sampling, session_id=session_id)
        if self.epoch != epoch:  # restarted while this call was in flight: its result is lost
            self.failed += 1
            raise EngineError(f"injected fault: engine restarted during call {n}")
        return gen

    async def info(self) -> EngineInfo:
        return await self.inner.info()

    async def update_weights_from_disk(self, path: str | Path, weight_version: int | None = None) -> int:
        return await self.inner.update_weights_from_disk(path, weight_version)

    async def close(self) -> None:
        return None  # the inner engine belongs to the run, which closes it
