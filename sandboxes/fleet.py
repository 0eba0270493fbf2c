"""FleetProvider: fleet control in front of any SandboxProvider (rate, starting cap, retries, warm).

Concept: `build_fleet(provider, FleetConfig)` is itself a SandboxProvider. Each creation, in order:
waits for a token of the creation bucket shared with every other process on the machine (or, with
`redis_url`, every rollout worker of the run: buckets.py), waits for one of `max_starting` slots
(creations in flight in this process), runs the provider's create (failed after `start_timeout_s`
if set: a sandbox stuck "starting" fails its episode), and on the provider's rate-limit refusal
(SandboxThrottled, SandboxRateLimited) sleeps a full-jitter exponential delay (at least the
backend's retry-after) and starts over, token included, at most `retry.attempts` times. Past that
it raises SandboxThrottled naming the attempts: the rollout records a FAILED episode, the run goes
on. With `warm_pool > 0` a SandboxPool (pool.py) sits on top and keeps that many ready sandboxes per
distinct spec, refilled through the same limiter while the fleet is entered (`async with`).

Invariants: a slot is held only while the provider's create runs (not while sleeping for a token or
a retry), so `starting` never exceeds `max_starting`; a cancelled or timed-out create leaves no
sandbox behind (providers clean up their own partial creations, as for SandboxPool). The orphan
reaper is the inner provider's (`reap()` forwards).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import anyio

from miles_env.errors import SandboxError, SandboxThrottled
from miles_env.sandbox import AsyncClosable, Sandbox, SandboxProvider
from miles_env.sandboxes.fleet_config import FleetConfig, RetryPolicy
from miles_env.types import SandboxSpec

from .buckets import Bucket, Clock, FileBucket, RedisBucket, SystemClock
from .pool import SandboxPool, reap_provider

__all__ = ["FleetStats", "FleetProvider", "build_fleet", "default_bucket"]


@dataclass(slots=True)
class FleetStats:
    created: int = 0
    retries: int = 0  # rate-limit refusals retried
    failed: int = 0  # creations given up (attempts spent, timeout, other error)
    token_wait_s: float = 0.0  # slept waiting for the shared bucket
    starting: int = 0  # creations in flight now
    max_starting_seen: int = 0


class _Admission:
    """The limiter as a SandboxProvider: bucket -> starting slot -> create, with retries."""

    def __init__(
        self,
        provider: SandboxProvider,
        config: FleetConfig,
        bucket: Bucket | None,
        clock: Clock,
        rng: random.Random,
        stats: FleetStats,
    ) -> None:
        self.provider, self.name, self.config = provider, provider.name, config
        self.bucket, self.clock, self.rng, self.stats = bucket, clock, rng, stats
        self._slots = anyio.Semaphore(config.max_starting) if config.max_starting else None

    async def _token(self) -> None:
        while self.bucket is not None:
            wait = self.bucket.try_take(self.clock.now())
            if wait <= 0.0:
                return
            self.stats.token_wait_s += wait
            await self.clock.sleep(wait)

    async def _start(self, spec: SandboxSpec) -> Sandbox:
        await self._token()
        if self._slots is not None:
            await self._slots.acquire()
        self.stats.starting += 1
        self.stats.max_starting_seen = max(self.stats.max_starting_seen, self.stats.starting)
        try:
            timeout = self.config.start_timeout_s
            try:
                with anyio.fail_after(timeout):
                    return await self.provider.create(spec)
            except TimeoutError:
                raise SandboxError(f"{self.name}: sandbox still starting after {timeout:g}s") from None
        finally:
            self.stats.starting -= 1
            if self._slots is not None:
                self._slots.release()

    async def create(self, spec: SandboxSpec) -> Sandbox:
        retry = self.config.retry
        for attempt in range(retry.attempts):
            try:
                sandbox = await self._start(spec)
            except SandboxThrottled as e:
                if attempt + 1 >= retry.attempts:
                    self.stats.failed += 1
                    raise SandboxThrottled(
                        f"{self.name}: still rate-limited after {retry.attempts} attempts: {e}",
                        e.retry_after,
                    ) from e
                self.stats.retries += 1
                await self.clock.sleep(retry.delay(attempt, e.retry_after, self.rng))
                continue
            except SandboxError:
                self.stats.failed += 1
                raise
            self.stats.created += 1
            return sandbox
        raise AssertionError("unreachable")


class FleetProvider:
    """SandboxProvider: `provider` behind the fleet's limiter (and a warm pool when configured)."""

    def __init__(
        self,
        provider: SandboxProvider,
        config: FleetConfig | None = None,
        *,
        bucket: Bucket | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.provider, self.name = provider, provider.name
        self.config = config or FleetConfig()
        self.stats = FleetStats()
        self.admission = _Admission(
            provider, self.config, bucket, clock or SystemClock(), rng or random.Random(), self.stats
        )
        self.pool: SandboxPool | None = None
        if self.config.warm_pool > 0:  # the pool never retries itself: the admission did
            self.pool = SandboxPool(
                self.admission, max_concurrency=1 << 20, warm=self.config.warm_pool,
                retry=RetryPolicy(attempts=1),
            )  # fmt: skip
        self._warmed: set[str] = set()
        self._tg: anyio.abc.TaskGroup | None = None

    async def create(self, spec: SandboxSpec) -> Sandbox:
        if self.pool is None:
            return await self.admission.create(spec)
        key = spec.model_dump_json()
        if key not in self._warmed and self._tg is not None:  # keep `warm_pool` of this spec ready
            self._warmed.add(key)
            self._tg.start_soon(self._prewarm, spec)
        return await self.pool.create(spec)

    async def _prewarm(self, spec: SandboxSpec) -> None:
        assert self.pool is not None
        try:
            await self.pool.prewarm(spec)
        except SandboxError:
            pass  # a later create() makes its sandbox cold and reports the error itself

    async def __aenter__(self) -> FleetProvider:
        if self.pool is not None:
            await self.pool.__aenter__()
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            self._tg = None
        if self.pool is not None:
            await self.pool.__aexit__(None, None, None)

    async def aclose(self) -> None:
        if self.pool is not None:
            await self.pool.aclose()
        if isinstance(self.provider, AsyncClosable):
            await self.provider.aclose()

    async def reap(self, ttl_s: float | None = None) -> list[str]:
        return await reap_provider(self.provider, ttl_s)


def default_bucket(config: FleetConfig, provider_name: str) -> Bucket | None:
    """The shared creation bucket `config` asks for: Redis (whole run), a file (this machine) or none."""
    rate = config.create_rate_per_s
    if rate is None:
        return None
    if config.redis_url is not None:
        return RedisBucket.from_url(config.redis_url, f"miles-env:fleet:{provider_name}", rate, config.burst)
    from miles_env.models import cache_dir

    folder = config.bucket_dir or Path(cache_dir()) / "fleet"
    return FileBucket(folder / f"{provider_name}.bucket", rate, config.burst)


def build_fleet(provider: SandboxProvider, config: FleetConfig) -> FleetProvider:
    return FleetProvider(provider, config, bucket=default_bucket(config, provider.name))
