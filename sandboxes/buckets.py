"""Token buckets for sandbox creations, shared beyond one process, and the clock they read.

Concept: a bucket holds up to `burst` tokens and gains `rate` per second; a creation takes one.
`try_take(now)` either takes a token (returns 0.0) or returns how long until one is there, so the
caller sleeps on its own clock and asks again. The state is two numbers (tokens, time of the last
take), kept where every sharer sees it:
- `FileBucket`: a JSON file under an exclusive `fcntl.flock`, for every process of one machine
  (the critical section is a read and a write of a few bytes, so it is taken on the event loop).
  Times are CLOCK_MONOTONIC (`time.monotonic`), one clock for all processes of a boot; a file
  from an earlier boot (a last take "in the future") is treated as full.
- `RedisBucket`: one Lua script on a Redis hash, for every process of every machine using that
  Redis (the rollout workers of a cluster run). Without an injected `now` the script reads Redis's
  own TIME, so machines with skewed clocks still share one timeline.

Invariant: over any window of T seconds at most `burst + rate * T` tokens are taken, whatever the
number of sharers. Tests drive both with a `ManualClock` (no sleeps).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio

__all__ = ["Clock", "SystemClock", "ManualClock", "Bucket", "FileBucket", "RedisBucket", "refill"]


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


@dataclass(frozen=True, slots=True)
class SystemClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


@dataclass(slots=True)
class ManualClock:
    """A clock that moves only when slept on (or `advance`d): each sleep adds its seconds at once."""

    t: float = 1000.0
    slept: list[float] = field(default_factory=list)

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += max(0.0, seconds)
        await anyio.lowlevel.checkpoint()

    def advance(self, seconds: float) -> None:
        self.t += seconds


class Bucket(Protocol):
    def try_take(self, now: float) -> float:
        """0.0: a token was taken; else the seconds until one will be there (nothing taken)."""
        ...


_EPS = 1e-9
_RECORD = 96  # bytes of the file bucket's record, JSON padded with spaces


def refill(tokens: float, last: float, now: float, rate: float, burst: int) -> tuple[float, float]:
    """(tokens after the take, wait): a take at `now` from a bucket last touched at `last`."""
    tokens = min(float(burst), tokens + max(0.0, now - last) * rate)
    if tokens >= 1.0 - _EPS:  # a sleep of exactly the wait must succeed despite float rounding
        return max(0.0, tokens - 1.0), 0.0
    return tokens, (1.0 - tokens) / rate


@dataclass(frozen=True, slots=True)
class FileBucket:
    path: Path
    rate: float
    burst: int

    def __post_init__(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def try_take(self, now: float) -> float:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            state = _read_state(fd)
            tokens, last = state if state is not None and state[1] <= now else (float(self.burst), now)
            tokens, wait = refill(tokens, last, now, self.rate, self.burst)
            if wait == 0.0:
                # one fixed-width record, overwritten in place (no truncate: it costs a ms on ext4)
                raw = json.dumps({"tokens": tokens, "t": now}).encode().ljust(_RECORD)
                os.pwrite(fd, raw, 0)
            return wait
        finally:
            os.close(fd)  # closing drops the lock


def _read_state(fd: int) -> tuple[float, float] | None:
    raw = os.pread(fd, 4096, 0)
    try:
        data = json.loads(raw)
        return float(data["tokens"]), float(data["t"])
    except (ValueError, KeyError, TypeError):  # empty (new) or torn by a crash: start full
        return None


# KEYS[1]: the bucket's hash; ARGV: rate, burst, now (< 0: Redis's own TIME). Returns the wait as a
# string (a Lua number would be truncated to an integer on the way out).
_TAKE = """
local rate, burst, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local s = redis.call('HMGET', KEYS[1], 'tokens', 't')
local tokens, last = tonumber(s[1]), tonumber(s[2])
if tokens == nil or last == nil or last > now then tokens, last = burst, now end
tokens = math.min(burst, tokens + (now - last) * rate)
if tokens < 1 - 1e-9 then return tostring((1 - tokens) / rate) end
redis.call('HSET', KEYS[1], 'tokens', tostring(math.max(0, tokens - 1)), 't', tostring(now))
redis.call('EXPIRE', KEYS[1], 86400)
return '0'
"""


class RedisBucket:
    """The bucket as a Redis hash `key`; `use_server_time` makes the script read Redis's TIME."""

    def __init__(
        self, client: Any, key: str, rate: float, burst: int, *, use_server_time: bool = True
    ) -> None:
        self.client, self.key, self.rate, self.burst = client, key, rate, burst
        self.use_server_time = use_server_time
        self._script = client.register_script(_TAKE)

    @classmethod
    def from_url(cls, url: str, key: str, rate: float, burst: int) -> RedisBucket:
        import redis

        return cls(redis.Redis.from_url(url), key, rate, burst)

    def try_take(self, now: float) -> float:
        arg = -1.0 if self.use_server_time else now
        out = self._script(keys=[self.key], args=[self.rate, self.burst, arg])
        return float(out.decode() if isinstance(out, bytes) else out)
