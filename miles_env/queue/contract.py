"""The replay queue's contract: what every backend (SQLite, Redis) offers the job and the trainer.

Concept: one synchronous, thread-safe surface (`ReplayQueue`) and the values it trades in
(`Lease`, `OpenGroup`, `QueueStats`, `GroupState`, `QueueError`), defined here so that every
backend imports this module and none imports another. The async orchestrator and the trainer loop
use a queue through `AsyncReplayQueue` (aio.py), which runs each call in a worker thread.
`SqliteReplayQueue` (sqlite.py) is the embedded default, `RedisReplayQueue` (redis.py) the shared
one; tests/queue_contract.py checks both against the same suite.

Semantics: rollout workers `put` episodes; a group (the episodes of one task sampled together,
sharing `group_id`) becomes *pending* once `group_size` episodes arrived. The trainer `take`s
pending groups under a lease, trains on them, and `ack`s them once the model state that saw them
is durable (a checkpoint). `release` or lease expiry returns a group to pending. Lifecycle of a
group: open -> pending -> leased -> acked, with leased -> pending (release, expiry, recover),
pending -> stale (staleness filter) and pending -> quarantined (checksum mismatch at take).

Staleness is judged per episode: an episode is stale when its version (its oldest sampled turn's,
`group_version`) is older than `current_version - max_staleness`. `take` returns a group's fresh
episodes as the lease's `episodes` and its stale ones apart (`stale`: never trained; the trainer
may count their rewards in the baseline); a group whose every sampled episode is stale (its newest
sampled version, `newest_version`, is too old) is dropped whole (counted). An episode with no
sampled turn is never stale, and a group of such episodes only is never dropped.

Invariants every backend keeps (INVARIANTS.md, "Queue and trainer"): an episode id is stored
once; a group is returned only when complete, never while leased or after it is acked; stale
episodes never train and wholly stale groups are dropped and counted; an episode whose stored bytes fail their sha256 is quarantined
with its group, never returned; `recover(trained ids)` acks what a checkpoint trained and
releases every other lease.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from miles_env.errors import MilesEnvError
from miles_env.types import Episode

__all__ = [
    "POLL_S",
    "UNSAMPLED_VERSION",
    "GroupState",
    "Lease",
    "OpenGroup",
    "QueueError",
    "QueueStats",
    "ReplayQueue",
    "group_version",
    "newest_version",
    "split_stale",
    "wait_for_capacity",
]

POLL_S = 0.05  # how often a producer blocked on back-pressure looks again (sync and async alike)

# what an episode with no sampled turn contributes to its group's weight version (the group's
# version is the min over its episodes, which staleness is judged by): nothing, so an episode
# aborted before its first turn (a dead engine, a sandbox that never started) cannot make a fresh
# group stale. A group of such episodes only is never stale: nothing in it was sampled.
UNSAMPLED_VERSION = 2**31 - 1


class QueueError(MilesEnvError):
    """The replay queue refused an operation (bad group, unknown lease, wrong group_size) or its
    storage failed (the message then carries the backend's, e.g. SQLite's "database or disk is full")."""


class GroupState(StrEnum):
    """A group's state, stored as its string value by every backend."""

    OPEN = "open"  # fewer than group_size episodes so far
    PENDING = "pending"  # complete, waiting for the trainer
    LEASED = "leased"
    ACKED = "acked"
    STALE = "stale"
    QUARANTINED = "quarantined"  # an episode's stored bytes failed their checksum


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    group_id: str
    episodes: tuple[Episode, ...]  # the ones fresh enough to train
    expires_at: float
    stale: tuple[Episode, ...] = ()  # past max_staleness at take: never trained (module docstring)

    @property
    def episode_ids(self) -> list[str]:
        """The ids this lease trains (its fresh episodes): what a checkpoint records."""
        return [e.id for e in self.episodes]


@dataclass(frozen=True, slots=True)
class OpenGroup:
    """A group with fewer than group_size episodes stored (its producer died between two puts):
    `n_have` episodes of task `task_id`; putting the missing ones under `group_id` completes it."""

    group_id: str
    task_id: str
    n_have: int


class QueueStats(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    group_size: int
    max_pending_groups: int
    open_groups: int
    pending_groups: int
    leased_groups: int
    acked_groups: int
    stale_groups: int
    quarantined_groups: int
    complete_groups: int
    episodes: dict[str, int]  # group state -> number of episodes
    stale_dropped_episodes: int
    quarantined_episodes: int  # episodes whose own bytes failed their checksum


def group_version(episode: Episode) -> int:
    """The weight version `episode` gives its group: its oldest sampled turn's, else UNSAMPLED_VERSION.
    The episode is stale when this is older than `current_version - max_staleness`."""
    return episode.min_weight_version if episode.sampled else UNSAMPLED_VERSION


def newest_version(current: int | None, episode: Episode) -> int:
    """A group's newest sampled episode version once `episode` joins it (`current`: before; None for
    a new group): what decides whether the whole group is stale. UNSAMPLED_VERSION while no
    episode of it was sampled (such a group is never stale)."""
    if not episode.sampled:
        return UNSAMPLED_VERSION if current is None else current
    v = episode.min_weight_version
    return v if current is None or current == UNSAMPLED_VERSION else max(current, v)


def split_stale(
    episodes: Sequence[Episode], oldest_ok: int | None
) -> tuple[tuple[Episode, ...], tuple[Episode, ...]]:
    """(fresh, stale) of a group's episodes; every one fresh without a filter (`oldest_ok` None)."""
    if oldest_ok is None:
        return tuple(episodes), ()
    fresh = tuple(e for e in episodes if group_version(e) >= oldest_ok)
    return fresh, tuple(e for e in episodes if group_version(e) < oldest_ok)


class ReplayQueue(Protocol):
    """A durable replay queue of GRPO groups (sqlite.py documents each method's semantics). Its
    anyio face is `AsyncReplayQueue(queue)` (aio.py); each backend also offers it as `.aio`."""

    group_size: int
    max_pending_groups: int

    def put(self, episode: Episode, *, block: bool = True, timeout: float | None = None) -> bool: ...

    def has_capacity(self) -> bool: ...

    def wait_for_capacity(self, timeout: float | None = None) -> bool: ...

    def take(
        self,
        n_groups: int,
        *,
        current_version: int = 0,
        max_staleness: int | None = None,
        lease_s: float = 600.0,
    ) -> list[Lease]: ...

    def ack(self, leases: Lease | Sequence[Lease]) -> None: ...

    def release(self, leases: Lease | Sequence[Lease]) -> None: ...

    def renew(self, leases: Lease | Sequence[Lease], lease_s: float) -> None: ...

    def recover(self, trained_episode_ids: Iterable[str]) -> tuple[int, int]: ...

    def stats(self) -> QueueStats: ...

    def open_groups(self) -> list[OpenGroup]: ...

    def close(self) -> None: ...


def wait_for_capacity(queue: ReplayQueue, timeout: float | None, poll_s: float = POLL_S) -> bool:
    """Block while `queue` holds max_pending_groups complete groups; False on timeout (both backends)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not queue.has_capacity():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True
