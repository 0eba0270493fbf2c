"""A gate between many shared holders (requests) and one exclusive holder (a weight sync, a restart).

Concept: `async with gate.shared()` around each request; `async with gate.exclusive()` waits
for the requests in flight to finish and holds new ones back until it exits. So no request sees
weights half loaded, and a restart never kills a request that was admitted after it began.

Invariant: exclusive holders run one at a time; a shared holder never runs beside one. Leaving
either side is shielded from cancellation, so a cancelled holder still releases the gate.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

__all__ = ["Gate"]


class Gate:
    """Shared holders (requests) and an exclusive holder (weight sync, restart) that drains them."""

    def __init__(self) -> None:
        self._cond = anyio.Condition()
        self._lock = anyio.Lock()  # one exclusive holder at a time
        self._exclusive = 0
        self._shared = 0

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            while self._exclusive:
                await self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                async with self._cond:
                    self._shared -= 1
                    self._cond.notify_all()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._lock:
            async with self._cond:
                self._exclusive += 1
                while self._shared:
                    await self._cond.wait()
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True):
                    async with self._cond:
                        self._exclusive -= 1
                        self._cond.notify_all()
