"""expose(): make a host HTTP endpoint reachable inside a local sandbox (which never reaches the
host's loopback by itself, with network `public` or without).

Concept: the zygote makes a listening socket inside the sandbox's network namespace (on its
127.0.0.1, at the host port's number, or one from 20000 up when a process inside holds it) and
hands us its fd; expose.py's HostListener accepts on it in our process and copies each
connection to the host TCP endpoint (threads, so it is independent of the caller's event loop).
Nothing runs inside the sandbox for it and nothing is mounted, so it works whatever the root
filesystem holds (no python3 needed). Bytes are forwarded as they arrive, so SSE streams pass
unbuffered.

Lifecycle: made on the first expose(); `close()` (from Sandbox.close) closes every listener and
the connections in flight.
"""

from __future__ import annotations

import anyio

from ..expose import ExposeTarget, HostListener
from .forkserver import Zygote

__all__ = ["Bridge"]


class Bridge:
    def __init__(self, zygote: Zygote) -> None:
        self.zygote = zygote
        self.listeners: list[HostListener] = []
        self.lock = anyio.Lock()

    async def expose(self, url: str) -> str:
        target = ExposeTarget.parse(url)
        async with self.lock:
            sock, port = await self.zygote.listen(target.port)
            self.listeners.append(HostListener.on(sock, (target.host, target.port)))
        return f"{target.scheme}://127.0.0.1:{port}{target.tail}"

    def close(self) -> None:
        for listener in self.listeners:
            listener.close()
