"""Sandbox fleet control (sandboxes/fleet.py, sandboxes/buckets.py, sandboxes/fleet_config.py).

Fake parts, each standing for what cannot run here: a provider that rate-limits like a cloud API
(refuses beyond N creations per window, by the test's clock) and a `ManualClock` (time moves only
when slept on), so every timing assertion is exact and no test sleeps for real. Real parts: the
file bucket's lock across two spawned processes, the Redis bucket's Lua script on a real
redis-server, the training loop with the tiny torch trainer and a SQLite queue, and the local
(bubblewrap) provider with the scripted engine behind the TITO proxy for an episode's Usage.
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from miles_env.errors import SandboxRateLimited, SandboxThrottled
from miles_env.sandboxes.buckets import FileBucket, ManualClock, RedisBucket, refill
from miles_env.sandboxes.cloud import map_sdk_error
from miles_env.sandboxes.fleet import FleetProvider
from miles_env.sandboxes.fleet_config import FleetConfig, RetryPolicy
from miles_env.types import SandboxSpec, Status
from tests.redis_server import RedisServer

SPEC = SandboxSpec()


class FakeSandbox:
    def __init__(self, i: int) -> None:
        self.id, self.workdir, self.closed = f"fake-{i}", "/workspace", False

    async def close(self) -> None:
        self.closed = True

    async def __aenter__(self) -> FakeSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class RateLimitedProvider:
    """Refuses (SandboxRateLimited) a creation beyond `limit` in any `window` seconds of `clock`;
    `gate`, when set, holds every creation until it is set (a sandbox "still starting")."""

    name = "fake"

    def __init__(self, clock: ManualClock, limit: int = 1 << 30, window: float = 1.0) -> None:
        self.clock, self.limit, self.window = clock, limit, window
        self.accepted: list[float] = []
        self.refused = 0
        self.in_flight = self.max_in_flight = 0
        self.gate: anyio.Event | None = None
        self.retry_after: float | None = None

    async def create(self, spec: SandboxSpec) -> FakeSandbox:
        now = self.clock.now()
        if sum(1 for t in self.accepted if now - t < self.window) >= self.limit:
            self.refused += 1
            raise SandboxRateLimited("fake: 429 Too Many Requests", self.retry_after)
        self.accepted.append(now)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await anyio.lowlevel.checkpoint()
        finally:
            self.in_flight -= 1
        return FakeSandbox(len(self.accepted))


def _fleet(
    provider: RateLimitedProvider, tmp_path: Path, rate: float | None, burst: int = 2, **cfg: object
) -> FleetProvider:
    config = FleetConfig(create_rate_per_s=rate, burst=burst, **cfg)  # type: ignore[arg-type]
    bucket = FileBucket(tmp_path / "fake.bucket", rate, burst) if rate else None
    return FleetProvider(provider, config, bucket=bucket, clock=provider.clock, rng=random.Random(7))


# -- the limiter --------------------------------------------------------------------------------


def test_the_bucket_holds_the_rate_exactly(tmp_path: Path) -> None:
    clock = ManualClock()
    fake = RateLimitedProvider(clock)
    fleet = _fleet(fake, tmp_path, rate=5.0, burst=2)

    async def main() -> None:
        for _ in range(12):
            await fleet.create(SPEC)

    anyio.run(main)
    start = 1000.0  # two at once (the burst), then one every 1/rate seconds
    expected = [start, start] + [start + 0.2 * k for k in range(1, 11)]
    assert fake.accepted == pytest.approx(expected)
    assert fleet.stats.token_wait_s == pytest.approx(2.0) and fleet.stats.created == 12


def test_below_the_providers_limit_nothing_is_refused_and_without_it_retries_recover(tmp_path: Path) -> None:
    """The provider allows 3 creations in any 1 s. A bucket that allows at most burst + rate * 1 s =
    1 + 2.5 of them never meets a refusal; with no rate limit the burst is refused and the jittered
    retries get every sandbox made anyway."""

    async def make(fleet: FleetProvider, n: int) -> None:
        for _ in range(n):
            await fleet.create(SPEC)

    limited = RateLimitedProvider(ManualClock(), limit=3, window=1.0)
    anyio.run(make, _fleet(limited, tmp_path, rate=2.5, burst=1), 15)
    assert limited.refused == 0 and len(limited.accepted) == 15

    free = RateLimitedProvider(ManualClock(), limit=3, window=1.0)
    unlimited = _fleet(free, tmp_path, rate=None, retry=RetryPolicy(attempts=20, base_s=0.1, max_s=2.0))
    anyio.run(make, unlimited, 15)
    assert free.refused > 0 and unlimited.stats.retries == free.refused
    assert len(free.accepted) == 15
    for i, t in enumerate(free.accepted):  # even so, the provider's own window was never exceeded
        assert sum(1 for u in free.accepted[: i + 1] if t - u < 1.0) <= 3


def test_the_starting_cap_holds(tmp_path: Path) -> None:
    fake = RateLimitedProvider(ManualClock())
    fleet = _fleet(fake, tmp_path, rate=None, max_starting=3)
    made: list[object] = []

    async def main() -> None:
        fake.gate = anyio.Event()

        async def one() -> None:
            made.append(await fleet.create(SPEC))

        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(one)
            await anyio.wait_all_tasks_blocked()
            assert fake.in_flight == 3 and fleet.stats.starting == 3  # 7 wait for a slot
            fake.gate.set()

    anyio.run(main)
    assert len(made) == 10 and fake.max_in_flight == 3 and fleet.stats.max_starting_seen == 3


def test_a_creation_stuck_starting_fails_after_its_timeout(tmp_path: Path) -> None:
    fake = RateLimitedProvider(ManualClock())
    fleet = _fleet(fake, tmp_path, rate=None, start_timeout_s=0.05)

    async def main() -> None:
        fake.gate = anyio.Event()  # never set: the sandbox never finishes starting
        with pytest.raises(Exception, match=r"still starting after 0.05s"):
            await fleet.create(SPEC)

    anyio.run(main)
    assert fake.in_flight == 0 and fleet.stats.failed == 1


# -- retries ------------------------------------------------------------------------------------


def _always_refused(retry: RetryPolicy, seed: int, retry_after: float | None = None) -> list[float]:
    clock = ManualClock()
    fake = RateLimitedProvider(clock, limit=0)
    fake.retry_after = retry_after
    fleet = FleetProvider(fake, FleetConfig(retry=retry), clock=clock, rng=random.Random(seed))

    async def main() -> None:
        with pytest.raises(SandboxThrottled, match=f"still rate-limited after {retry.attempts} attempts"):
            await fleet.create(SPEC)

    anyio.run(main)
    assert fake.refused == retry.attempts and fleet.stats.retries == retry.attempts - 1
    return clock.slept


def test_retries_are_jittered_bounded_and_honour_retry_after() -> None:
    policy = RetryPolicy(attempts=5, base_s=1.0, max_s=4.0, multiplier=2.0)
    delays = _always_refused(policy, seed=1)
    assert len(delays) == 4  # one sleep between each two of the 5 attempts
    for attempt, d in enumerate(delays):
        assert 0.0 <= d <= min(4.0, 2.0**attempt)  # full jitter under the exponential ceiling
    assert delays != _always_refused(policy, seed=2)  # jittered: another draw, other delays
    assert all(d >= 2.5 for d in _always_refused(policy, seed=1, retry_after=2.5))


def test_cloud_429s_map_to_the_rate_limit_error() -> None:
    class TooManyRequestsError(Exception):
        retry_after = 3

    e = map_sdk_error(TooManyRequestsError("slow down"), "create")
    assert isinstance(e, SandboxRateLimited) and e.retry_after == 3.0
    quota = map_sdk_error(RuntimeError("QuotaExceeded: 20 sandboxes"), "create")
    assert isinstance(quota, SandboxThrottled) and not isinstance(quota, SandboxRateLimited)


def test_a_warm_pool_of_the_configured_size_serves_the_next_creation(tmp_path: Path) -> None:
    fake = RateLimitedProvider(ManualClock())
    fleet = _fleet(fake, tmp_path, rate=None, warm_pool=2)

    async def main() -> None:
        async with fleet:
            first = await fleet.create(SPEC)  # cold; starts keeping 2 of this spec warm
            await anyio.wait_all_tasks_blocked()
            assert fleet.pool is not None and sum(len(q) for q in fleet.pool._warm.values()) == 2
            second = await fleet.create(SPEC)
            assert fleet.pool.stats.warm_hits == 1
            await first.close()
            await second.close()

    anyio.run(main)
    assert len(fake.accepted) >= 3


# -- one bucket for several processes -----------------------------------------------------------

_CHILD = """
import sys
from pathlib import Path
from miles_env.sandboxes.buckets import FileBucket
bucket = FileBucket(Path(sys.argv[1]), rate=1e-9, burst=int(sys.argv[2]))
taken = sum(1 for _ in range(int(sys.argv[3])) if bucket.try_take(100.0) == 0.0)
Path(sys.argv[4]).write_text(str(taken))
"""


def test_two_processes_share_one_file_bucket(tmp_path: Path) -> None:
    """Two processes take from one bucket at the same instant (a frozen `now`, no refill): together
    they get exactly the burst, never more, however their takes interleave."""
    path, burst = tmp_path / "local.bucket", 60
    outs = [tmp_path / "a.out", tmp_path / "b.out"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(path), str(burst), "50", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for out in outs
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    counts = [int(o.read_text()) for o in outs]
    assert sum(counts) == burst and min(counts) >= 10  # both took; 100 asked for, 60 there
    assert FileBucket(path, 1e-9, burst).try_take(100.0) > 0  # empty for this process too


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with RedisServer(tmp_path / "redis") as server:
        yield server.url


def test_rollout_workers_share_one_redis_bucket(redis_url: str) -> None:
    import redis

    clients = [redis.Redis.from_url(redis_url) for _ in range(2)]
    buckets = [RedisBucket(c, "miles-env:fleet:test", 2.0, 3, use_server_time=False) for c in clients]
    taken = [b.try_take(50.0) for b in (buckets[0], buckets[1]) * 3]
    assert taken[:3] == [0.0, 0.0, 0.0]  # the burst, across both "workers"
    assert taken[3] == pytest.approx(0.5)  # then 1/rate to wait, whoever asks
    assert buckets[1].try_take(50.5) == 0.0 and buckets[0].try_take(50.5) == pytest.approx(0.5)
    server_time = RedisBucket(clients[0], "miles-env:fleet:server-time", 2.0, 1)
    assert server_time.try_take(0.0) == 0.0 and 0.0 < server_time.try_take(0.0) <= 0.5
    for c in clients:
        c.close()


def test_a_permanent_rate_limit_is_a_failed_episode_not_a_crash(tmp_path: Path) -> None:
    from miles_env.engines.scripted import ScriptedEngine
    from miles_env.harnesses import get_harness
    from miles_env.models import load_tokenizer
    from miles_env.registry import load_environment
    from miles_env.rollout import run_episode
    from miles_env.stack import StackConfig, open_stack

    env = load_environment("terminal-basics")
    task = env.tasks("train")[0]
    clock = ManualClock()
    fake = RateLimitedProvider(clock, limit=0)
    fleet = FleetProvider(fake, FleetConfig(retry=RetryPolicy(attempts=3)), clock=clock)

    async def main() -> None:
        engine = ScriptedEngine(load_tokenizer("smollm2"))
        async with open_stack(StackConfig(engine={"kind": "scripted"}), engine=engine) as stack:
            ctx = dataclasses.replace(stack.rollout_context(env, get_harness("builtin")), provider=fleet)
            ep = await run_episode(ctx, task)
            assert ep.status is Status.FAILED and ep.reward is None
            assert "still rate-limited after 3 attempts" in (ep.error or "")
            assert ep.usage is not None and ep.usage.sandbox_s == 0.0  # no sandbox, nothing billed

    anyio.run(main)
    assert fake.refused == 3 and len(clock.slept) == 2


def test_refill_arithmetic() -> None:
    assert refill(0.0, 10.0, 11.0, rate=2.0, burst=5) == (1.0, 0.0)
    assert refill(0.5, 10.0, 10.0, rate=2.0, burst=5) == (0.5, 0.25)
    assert refill(4.0, 0.0, 100.0, rate=2.0, burst=5) == (4.0, 0.0)  # capped at the burst
