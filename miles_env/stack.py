"""The rollout stack: engine + TITO proxy (served on loopback) + sandbox provider.

Lifecycle: `async with open_stack(cfg) as stack:` builds the engine, wraps it in
a TitoProxy, serves the proxy's HTTP app on a free loopback port and builds the
sandbox provider; everything is closed on exit, also on Ctrl-C. `eval` and
`train` both run on it, so an episode is produced the same way in both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from miles_env.config import RunConfig, SandboxConfig
from miles_env.cost import CostConfig
from miles_env.engines.base import Engine
from miles_env.engines.configs import EngineConfig, HFEngineConfig
from miles_env.environment import Environment
from miles_env.harness import Harness, SessionRecorder
from miles_env.http import serve_app
from miles_env.limits import LimitsOverride
from miles_env.rollout import RolloutContext
from miles_env.sandbox import AsyncClosable, SandboxProvider
from miles_env.sandboxes.fleet_config import FleetConfig
from miles_env.tito.config import TitoConfig

__all__ = ["StackConfig", "Stack", "open_stack", "run_fleet"]


class StackConfig(BaseModel):
    """The run config's sections a stack is made of (a RunConfig's own models, or plain dicts)."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=HFEngineConfig)
    tito: TitoConfig = Field(default_factory=TitoConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    store_dir: Path | None = None  # where the proxy persists sessions
    fleet: FleetConfig = Field(default_factory=FleetConfig)  # the provider is built behind it
    cost: CostConfig = Field(default_factory=CostConfig)  # prices every episode's Usage


@dataclass
class Stack:
    engine: Engine
    proxy: SessionRecorder  # miles_env.tito.TitoProxy
    proxy_url: str
    provider: SandboxProvider  # the configured provider behind the fleet (sandboxes/fleet.py)
    tokenizer: Any
    cost: CostConfig = field(default_factory=CostConfig)

    def rollout_context(
        self,
        env: Environment,
        harness: Harness,
        episode_timeout_s: float = 600.0,
        limits: LimitsOverride | None = None,
    ) -> RolloutContext:
        return RolloutContext(
            env, harness, self.provider, self.proxy, self.proxy_url, episode_timeout_s, limits,
            cost=self.cost,
        )  # fmt: skip


def run_fleet(cfg: RunConfig) -> FleetConfig:
    """The run's fleet section; on a Redis queue its creation bucket is shared through that Redis
    (every rollout worker of the run, on every node), unless fleet.redis_url names another."""
    from miles_env.queue.config import RedisQueueConfig

    if isinstance(cfg.queue, RedisQueueConfig) and cfg.fleet.redis_url is None:
        return cfg.fleet.model_copy(update={"redis_url": cfg.queue.url})
    return cfg.fleet


@asynccontextmanager
async def open_stack(cfg: StackConfig, *, engine: Any | None = None) -> AsyncIterator[Stack]:
    """Build the stack; pass `engine` to reuse one that already exists (the trainer's, in process)."""
    from miles_env.engines import build_engine
    from miles_env.models import load_tokenizer
    from miles_env.sandboxes import get_provider
    from miles_env.sandboxes.fleet import build_fleet
    from miles_env.tito import TitoProxy, create_app

    # fail fast on a missing bwrap; every creation goes through the fleet's limiter
    provider = build_fleet(get_provider(cfg.sandbox.provider, **cfg.sandbox.options), cfg.fleet)
    own_engine = engine is None
    if engine is None:
        engine = await build_engine(cfg.engine)
    try:
        tokenizer = load_tokenizer(cfg.engine.model)
        proxy = TitoProxy(engine, tokenizer, cfg.tito, store_dir=cfg.store_dir)
        async with serve_app(create_app(proxy)) as url, provider:
            yield Stack(engine, proxy, url, provider, tokenizer, cfg.cost)
    finally:
        if isinstance(provider, AsyncClosable):  # e.g. the local provider's idle zygotes
            await provider.aclose()
        if own_engine:
            await engine.close()
