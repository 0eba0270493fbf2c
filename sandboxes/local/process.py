"""Run one process under a wall-clock limit and per-stream output caps.

Invariant: when `run_capped` returns or is cancelled, the process group it
started is dead (SIGKILL to the group; bwrap's --die-with-parent and the pid
namespace take every descendant with it). Output beyond the cap is drained and
dropped; far beyond it (`kill_factor` x cap) the process is killed, so a
command printing 1 GB costs neither memory nor time.
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
from anyio.abc import ByteReceiveStream, Process

__all__ = ["RawResult", "run_capped"]

_CHUNK = 65536


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


def _kill_group(process: Process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _drain(stream: ByteReceiveStream | None, cap: _Capture, limit: int, on_over: anyio.Event) -> None:
    if stream is None:
        return
    async for chunk in stream:
        room = cap.cap - len(cap.data)
        if room > 0:
            cap.data += chunk[:room]
        cap.seen += len(chunk)
        if cap.seen > limit:
            on_over.set()
            return


async def _feed(process: Process, stdin: bytes | None) -> None:
    if process.stdin is None:
        return
    try:
        if stdin:
            await process.stdin.send(stdin)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, BrokenPipeError):
        pass  # the command exited without reading all of its input
    finally:
        await process.stdin.aclose()


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
    start = time.perf_counter()
    process = await anyio.open_process(
        list(argv),
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        start_new_session=True,
        pass_fds=pass_fds,
    )
    if live is not None:
        live.add(process.pid)
    out, err = _Capture(output_cap), _Capture(output_cap)
    limit = output_cap * kill_factor + _CHUNK
    over = anyio.Event()
    timed_out = False
    try:
        with anyio.move_on_after(timeout if math.isfinite(timeout) else None) as scope:
            async with anyio.create_task_group() as tg:

                async def watch_over() -> None:
                    await over.wait()
                    _kill_group(process)

                tg.start_soon(watch_over)
                tg.start_soon(_feed, process, stdin)
                # EOF on both pipes comes when the pid namespace is gone, so the
                # tail of the output is never lost to a race with wait().
                async with anyio.create_task_group() as pumps:
                    pumps.start_soon(_drain, process.stdout, out, limit, over)
                    pumps.start_soon(_drain, process.stderr, err, limit, over)
                await process.wait()
                tg.cancel_scope.cancel()
        timed_out = scope.cancelled_caught
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                _kill_group(process)
            await process.wait()
            await process.aclose()
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
