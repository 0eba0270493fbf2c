"""Run one process under a wall-clock limit and per-stream output caps.

Invariant: when `collect` returns or is cancelled, the process group it watches
is dead (SIGKILL to the group; bwrap's --die-with-parent and the pid namespace
take every descendant with it) and reaped. Output beyond the cap is drained and
dropped; far beyond it (`kill_factor` x cap) the process is killed, so a command
printing 1 GB costs neither memory nor time.

Why plain `subprocess.Popen` and fd readiness (anyio.wait_readable, a pidfd for
the exit) rather than anyio.open_process: a process started ahead of time
(spare.py) must not belong to one event loop, since a provider can outlive it.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio

__all__ = ["RawResult", "collect", "reap", "run_capped", "spawn"]

_CHUNK = 65536
Popen = subprocess.Popen


@dataclass(slots=True)
class _Capture:
    cap: int
    data: bytearray = field(default_factory=bytearray)
    seen: int = 0

    @property
    def truncated(self) -> bool:
        return self.seen > self.cap


@dataclass(frozen=True, slots=True)
class RawResult:
    returncode: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    output_killed: bool
    truncated: bool
    duration_s: float


def spawn(argv: Sequence[str], *, pass_fds: Sequence[int] = ()) -> Popen[bytes]:
    """Start `argv` as the leader of a new session, with three non-blocking pipes."""
    process = subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
    )
    for pipe in (process.stdin, process.stdout, process.stderr):
        assert pipe is not None
        os.set_blocking(pipe.fileno(), False)
    return process


def kill_group(process: Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def reap(process: Popen[bytes]) -> int:
    """Wait for the exit without blocking the event loop, reap it, close its pipes."""
    if process.returncode is None:
        pidfd = os.pidfd_open(process.pid)
        try:
            while process.poll() is None:
                await anyio.wait_readable(pidfd)
        finally:
            os.close(pidfd)
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()
    assert process.returncode is not None
    return process.returncode


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


async def _feed(process: Popen[bytes], data: bytes | None) -> None:
    assert process.stdin is not None
    view = memoryview(data or b"")
    try:
        while view:
            try:
                view = view[os.write(process.stdin.fileno(), view) :]
            except BlockingIOError:
                await anyio.wait_writable(process.stdin.fileno())
    except (BrokenPipeError, ConnectionResetError):
        pass  # the command exited without reading all of its input
    finally:
        process.stdin.close()


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
    """spawn() `argv` and collect() it."""
    start = time.perf_counter()
    process = spawn(argv, pass_fds=pass_fds)
    if live is not None:
        live.add(process.pid)
    return await collect(
        process,
        stdin=stdin,
        timeout=timeout,
        output_cap=output_cap,
        kill_factor=kill_factor,
        live=live,
        start=start,
    )


async def collect(
    process: Popen[bytes],
    *,
    stdin: bytes | None,
    timeout: float,
    output_cap: int,
    kill_factor: int = 4,
    live: set[int] | None = None,
    start: float | None = None,
) -> RawResult:
    """Feed `stdin`, capture capped output and wait, for a spawn()ed process."""
    start = time.perf_counter() if start is None else start
    assert process.stdout is not None and process.stderr is not None
    out, err = _Capture(output_cap), _Capture(output_cap)
    limit = output_cap * kill_factor + _CHUNK
    over = anyio.Event()
    timed_out = False
    try:
        with anyio.move_on_after(timeout if math.isfinite(timeout) else None) as scope:
            async with anyio.create_task_group() as tg:

                async def watch_over() -> None:
                    await over.wait()
                    kill_group(process)

                tg.start_soon(watch_over)
                tg.start_soon(_feed, process, stdin)
                # EOF on both pipes comes when the pid namespace is gone, so the
                # tail of the output is never lost to a race with the exit.
                async with anyio.create_task_group() as pumps:
                    pumps.start_soon(_drain, process.stdout.fileno(), out, limit, over)
                    pumps.start_soon(_drain, process.stderr.fileno(), err, limit, over)
                await reap(process)
                tg.cancel_scope.cancel()
        timed_out = scope.cancelled_caught
    finally:
        with anyio.CancelScope(shield=True):
            if process.poll() is None:
                kill_group(process)
            await reap(process)
        if live is not None:
            live.discard(process.pid)
    return RawResult(
        returncode=process.returncode if process.returncode is not None else -signal.SIGKILL,
        stdout=bytes(out.data),
        stderr=bytes(err.data),
        timed_out=timed_out,
        output_killed=over.is_set(),
        truncated=out.truncated or err.truncated,
        duration_s=time.perf_counter() - start,
    )
