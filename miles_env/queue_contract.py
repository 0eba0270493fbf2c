"""The replay queue's contract: what every backend (SQLite, Redis) offers the job and the trainer.

Concept: one synchronous, thread-safe surface (`ReplayQueue`); the async orchestrator and the
trainer loop use it through `AsyncReplayQueue` (queue_aio.py), which runs each call in a worker
thread. `SqliteReplayQueue` (queue.py) is the embedded default, `RedisReplayQueue`
(queue_redis.py) the shared one; tests/queue_contract.py checks both against the same suite.

Invariants every backend keeps (INVARIANTS.md, "Queue and trainer"): an episode id is stored
once; a group is returned only when complete, never while leased or after it is acked; stale
groups are dropped and counted; an episode whose stored bytes fail their sha256 is quarantined
with its group, never returned; `recover(trained ids)` acks what a checkpoint trained and
releases every other lease.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from miles_env.types import Episode

if TYPE_CHECKING:
    from miles_env.queue import Lease, OpenGroup, QueueStats
    from miles_env.queue_aio import AsyncReplayQueue

__all__ = ["UNSAMPLED_VERSION", "ReplayQueue", "group_version", "wait_for_capacity"]

# what an episode with no sampled turn contributes to its group's weight version (the group's
# version is the min over its episodes, which staleness is judged by): nothing, so an episode
# aborted before its first turn (a dead engine, a sandbox that never started) cannot make a fresh
# group stale. A group of such episodes only is never stale: nothing in it was sampled.
UNSAMPLED_VERSION = 2**31 - 1


def group_version(episode: Episode) -> int:
    """The weight version `episode` gives its group: its oldest sampled turn's, else UNSAMPLED_VERSION."""
    return episode.min_weight_version if episode.sampled else UNSAMPLED_VERSION


class ReplayQueue(Protocol):
    """A durable replay queue of GRPO groups (see queue.py for the semantics of each method)."""

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

    @property
    def aio(self) -> AsyncReplayQueue: ...


def wait_for_capacity(queue: ReplayQueue, timeout: float | None, poll_s: float) -> bool:
    """Block while `queue` holds max_pending_groups complete groups; False on timeout (both backends)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not queue.has_capacity():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True
