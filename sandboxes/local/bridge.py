"""expose(): make a host HTTP endpoint reachable inside a sandbox that has no network.

Concept: host side, a Unix socket `<sandbox>/run/expose-N.sock` accepts
connections and copies bytes to the host TCP endpoint (expose.py's HostListener:
threads, so it is independent of the caller's event loop). Sandbox side, the
stdlib forwarder (sandboxes/forwarder.py) listens on 127.0.0.1:INNER inside a network namespace and copies
to that socket. The first expose() starts the forwarder in a fresh bwrap whose
network namespace then becomes the sandbox's: later execs (and forwarders) join
it (`netns()`: nsenter, or the zygote itself) as root before dropping to the
sandbox's uid, so they still see only `lo`, now with the bridge on it. The
forwarder has no capabilities, so a host port below 1024 is served inside on a
port from 20000 up.

Lifecycle: created on the first expose(); `aclose()` (from Sandbox.close) kills
the forwarders and closes every host socket. Bytes are forwarded as they
arrive, so SSE streams pass unbuffered.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import anyio
from anyio.abc import Process

from miles_env.errors import SandboxError

from ..expose import FORWARDER, INNER_RUN, ExposeTarget, HostListener

__all__ = ["Bridge"]


class Bridge:
    def __init__(
        self,
        run_dir: Path,
        bwrap_prefix: list[str],
        limit_prefix: list[str],
        drop_prefix: list[str],
        python: str,
    ) -> None:
        self.run_dir = run_dir
        self.bwrap_prefix = bwrap_prefix
        self.limit_prefix = limit_prefix
        self.drop_prefix = drop_prefix
        self.python = python
        self.listeners: list[HostListener] = []
        self.processes: list[Process] = []
        self.ns_pid: int | None = None
        self.ports: set[int] = set()
        self.lock = anyio.Lock()
        shutil.copyfile(FORWARDER, run_dir / "forwarder.py")

    def netns(self) -> str | None:
        """The sandbox's network namespace once the first forwarder made it."""
        return f"/proc/{self.ns_pid}/ns/net" if self.ns_pid else None

    def _inner_port(self, port: int) -> int:
        inner = port if port >= 1024 else 20000
        while inner in self.ports:
            inner = 20000 + len(self.ports) if inner < 20000 else inner + 1
        self.ports.add(inner)
        return inner

    async def expose(self, url: str, live: set[int]) -> str:
        target = ExposeTarget.parse(url)
        async with self.lock:
            n = len(self.listeners)
            sock_path = self.run_dir / f"expose-{n}.sock"
            self.listeners.append(HostListener(str(sock_path), (target.host, target.port)))
            os.chmod(
                sock_path, 0o666
            )  # the forwarder runs as the sandbox's uid (the host port is open to all anyway)
            inner = self._inner_port(target.port)
            await self._start_forwarder(inner, f"{INNER_RUN}/expose-{n}.sock", live)
        return f"{target.scheme}://127.0.0.1:{inner}{target.tail}"

    async def _start_forwarder(self, inner_port: int, inner_sock: str, live: set[int]) -> None:
        first = self.ns_pid is None
        bwrap = list(self.bwrap_prefix)
        # Mount points must be made before the root is remounted read-only.
        at = bwrap.index("--remount-ro")
        bwrap[at:at] = ["--bind", str(self.run_dir), INNER_RUN]
        outer = ["nsenter", f"--net={netns}", "--"] if (netns := self.netns()) else []
        argv = [*self.limit_prefix, *outer, *self.drop_prefix, *bwrap]
        if not first:
            argv.append("--share-net")
        read_fd, write_fd = os.pipe()
        argv += ["--info-fd", str(write_fd), "--"]
        argv += [self.python, "-u", f"{INNER_RUN}/forwarder.py", str(inner_port), inner_sock]
        try:
            proc = await anyio.open_process(
                argv, stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(write_fd,)
            )
        finally:
            os.close(write_fd)
        self.processes.append(proc)
        live.add(proc.pid)
        with os.fdopen(read_fd, "rb") as info_pipe:
            info = await anyio.to_thread.run_sync(info_pipe.read)
        assert proc.stdout is not None
        line = b""
        with anyio.move_on_after(20):
            try:
                line = await proc.stdout.receive()
            except anyio.EndOfStream:
                pass
        if not line.startswith(b"READY"):
            err = b""
            if proc.stderr is not None:
                with anyio.move_on_after(1):
                    try:
                        err = await proc.stderr.receive()
                    except anyio.EndOfStream:
                        pass
            raise SandboxError(f"expose: the in-sandbox forwarder did not start: {(line + err)[-500:]!r}")
        if first:
            self.ns_pid = int(json.loads(info)["child-pid"])

    async def aclose(self) -> None:
        for proc in self.processes:
            try:
                os.killpg(proc.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self.processes:
            await proc.wait()
            await proc.aclose()
        for listener in self.listeners:
            listener.close()
