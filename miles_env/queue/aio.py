"""The anyio face of the replay queue: `AsyncReplayQueue(queue)`, also a backend's `.aio`.

Concept: one implementation, the synchronous thread-safe queue of either backend (contract.py's
`ReplayQueue`); each call here runs the sync method in a worker thread. Waiting for capacity polls
with anyio.sleep, so a blocked producer holds no thread, and polls rather than waits on an Event
because the consumer that frees capacity may be another process.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import anyio
import anyio.to_thread

from miles_env.queue.contract import POLL_S, Lease, OpenGroup, QueueStats, ReplayQueue
from miles_env.types import Episode

__all__ = ["AsyncReplayQueue"]


class AsyncReplayQueue:
    """anyio face of a ReplayQueue (SQLite or Redis): each call runs the sync method in a worker
    thread; waiting for capacity polls with anyio.sleep so a blocked producer holds no thread."""

    def __init__(self, queue: ReplayQueue) -> None:
        self.sync = queue

    async def wait_for_capacity(self) -> None:
        # Polling, not an Event: the consumer that frees capacity may be another process.
        while not await anyio.to_thread.run_sync(self.sync.has_capacity):  # noqa: ASYNC110
            await anyio.sleep(POLL_S)

    async def put(self, episode: Episode) -> bool:
        await self.wait_for_capacity()
        return await anyio.to_thread.run_sync(lambda: self.sync.put(episode, block=False))

    async def take(
        self,
        n_groups: int,
        *,
        current_version: int = 0,
        max_staleness: int | None = None,
        lease_s: float = 600.0,
    ) -> list[Lease]:
        return await anyio.to_thread.run_sync(
            lambda: self.sync.take(
                n_groups, current_version=current_version, max_staleness=max_staleness, lease_s=lease_s
            )
        )

    async def ack(self, leases: Lease | Sequence[Lease]) -> None:
        await anyio.to_thread.run_sync(self.sync.ack, leases)

    async def release(self, leases: Lease | Sequence[Lease]) -> None:
        await anyio.to_thread.run_sync(self.sync.release, leases)

    async def renew(self, leases: Lease | Sequence[Lease], lease_s: float) -> None:
        await anyio.to_thread.run_sync(self.sync.renew, leases, lease_s)

    async def recover(self, trained_episode_ids: Iterable[str]) -> tuple[int, int]:
        ids = list(trained_episode_ids)
        return await anyio.to_thread.run_sync(self.sync.recover, ids)

    async def stats(self) -> QueueStats:
        return await anyio.to_thread.run_sync(self.sync.stats)

    async def open_groups(self) -> list[OpenGroup]:
        return await anyio.to_thread.run_sync(self.sync.open_groups)
