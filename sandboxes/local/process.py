"""Run one process under a wall-clock limit and per-stream output caps.

Invariant: when `collect` returns or is cancelled, the process group it watches
is dead (SIGKILL to the group; bwrap's --die-with-parent and the pid namespace
take every descendant with it) and reaped. Output beyond the cap is drained and
dropped; far beyond it (`kill_factor` x cap) the process is killed, so a command
printing 1 GB costs neither memory nor time.

`collect` works on any Child: a process we spawned (PopenChild) or one a zygote
forked for us (forkserver.ZygoteChild), so it reads raw pipe fds with
anyio.wait_readable rather than an event loop's process streams.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import anyio

from ..results import RawResult

__all__ = ["Child", "PopenChild", "collect", "run_capped"]

_CHUNK = 65536


class Child(Protocol):
    """A running command: our ends of its pipes (fds), a way to kill all of it, its exit."""

    stdin: int
    stdout: int
    stderr: int

    def kill(self) -> None: ...
    def poll(self) -> int | None: ...
    async def wait(self) -> int: ...
    def close_pipes(self) -> None: ...


class PopenChild:
    """A Child we started ourselves: reaped through a pidfd, so no event loop owns it."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        self.pid = process.pid
        assert process.stdin and process.stdout and process.stderr
        self.stdin, self.stdout, self.stderr = (
            p.fileno() for p in (process.stdin, process.stdout, process.stderr)
        )
        for fd in (self.stdin, self.stdout, self.stderr):
            os.set_blocking(fd, False)

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)  # the session we started it in
        except (ProcessLookupError, PermissionError):
            pass

    def poll(self) -> int | None:
        return self.process.poll()

    async def wait(self) -> int:
        if self.process.returncode is None:
            pidfd = os.pidfd_open(self.pid)
            try:
                while self.process.poll() is None:
                    await anyio.wait_readable(pidfd)
            finally:
                os.close(pidfd)
        assert self.process.returncode is not None
        return self.process.returncode

    def close_pipes(self) -> None:
        for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()


@dataclass(slots=True)
class _Capture:
    cap: int
    data: bytearray = field(default_factory=bytearray)
    seen: int = 0

    @property
    def truncated(self) -> bool:
        return self.seen > self.cap


async def _drain(fd: int, cap: _Capture, limit: int, on_over: anyio.Event) -> None:
    while True:
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            await anyio.wait_readable(fd)
            continue
        if not chunk:
            return
        room = cap.cap - len(cap.data)
        if room > 0:
            cap.data += chunk[:room]
        cap.seen += len(chunk)
        if cap.seen > limit:
            on_over.set()
            return


async def _feed(child: Child, data: bytes | None) -> None:
    view = memoryview(data or b"")
    try:
        while view:
            try:
                view = view[os.write(child.stdin, view) :]
            except BlockingIOError:
                await anyio.wait_writable(child.stdin)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the command exited without reading all of its input
    finally:
        _close_stdin(child)


def _close_stdin(child: Child) -> None:
    """EOF for the command's stdin (the fd itself is closed with the others by close_pipes)."""
    if isinstance(child, PopenChild):
        assert child.process.stdin is not None
        child.process.stdin.close()
    elif child.stdin >= 0:
        os.close(child.stdin)
        child.stdin = -1


def _popen(argv: Sequence[str], pass_fds: Sequence[int]) -> subprocess.Popen[bytes]:
    # A plain fork+exec on the caller's thread, as asyncio's own subprocess support does.
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
    )


async def run_capped(
    argv: Sequence[str],
    *,
    stdin: bytes | None,
    timeout: float,
    output_cap: int,
    kill_factor: int = 4,
    pass_fds: Sequence[int] = (),
    live: set[int] | None = None,
) -> RawResult:
    """Start `argv` (new session, three pipes) and collect() it."""
    start = time.perf_counter()
    child = PopenChild(_popen(argv, pass_fds))
    if live is not None:
        live.add(child.pid)
    try:
        return await collect(
            child, stdin=stdin, timeout=timeout, output_cap=output_cap, kill_factor=kill_factor, start=start
        )
    finally:
        if live is not None:
            live.discard(child.pid)


async def collect(
    child: Child,
    *,
    stdin: bytes | None,
    timeout: float,
    output_cap: int,
    kill_factor: int = 4,
    start: float | None = None,
) -> RawResult:
    """Feed `stdin`, capture capped output and wait for the exit; always kills and reaps."""
    start = time.perf_counter() if start is None else start
    out, err = _Capture(output_cap), _Capture(output_cap)
    limit = output_cap * kill_factor + _CHUNK
    over = anyio.Event()
    timed_out = False
    try:
        with anyio.move_on_after(timeout if math.isfinite(timeout) else None) as scope:
            async with anyio.create_task_group() as tg:

                async def watch_over() -> None:
                    await over.wait()
                    child.kill()

                tg.start_soon(watch_over)
                tg.start_soon(_feed, child, stdin)
                # EOF on both pipes comes when the pid namespace is gone, so the
                # tail of the output is never lost to a race with the exit.
                async with anyio.create_task_group() as pumps:
                    pumps.start_soon(_drain, child.stdout, out, limit, over)
                    pumps.start_soon(_drain, child.stderr, err, limit, over)
                await child.wait()
                tg.cancel_scope.cancel()
        timed_out = scope.cancelled_caught
    finally:
        with anyio.CancelScope(shield=True):
            if child.poll() is None:
                child.kill()
            code = await child.wait()
            child.close_pipes()
    return RawResult(
        returncode=code,
        stdout=bytes(out.data),
        stderr=bytes(err.data),
        timed_out=timed_out,
        output_killed=over.is_set(),
        truncated=out.truncated or err.truncated,
        duration_s=time.perf_counter() - start,
    )
