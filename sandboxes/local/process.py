"""Collect one exec: feed stdin, capture capped output, wait for the command, kill it on a limit.

Concept: an exec's result is the command's exit status and what it wrote. Processes it starts
in the background keep running (the sandbox is one process space, like a container), and they
may hold its stdout and stderr open: so `collect` returns once the command itself has exited
and its pipes reached EOF, or OUTPUT_GRACE_S after its exit, whichever comes first (docker exec
waits for such pipes too, ~2 s). Pipes still open then are handed to the `_Sink`, a thread that
reads and drops what they get until EOF, so a server that logs to its inherited stdout neither
blocks on a full pipe nor dies of SIGPIPE (docker keeps draining them as well).

Invariant: when `collect` returns after a timeout, an output flood or a cancellation, the
command and every process of its session (what it ran, background jobs included; not what called
setsid itself, which lives until the sandbox closes) are dead (Child.kill). Output beyond the cap
is drained and dropped; far beyond it (`kill_factor` x cap) the command is killed, so a command
printing 1 GB costs neither memory nor time.
"""

from __future__ import annotations

import math
import os
import selectors
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import anyio

from ..results import RawResult

__all__ = ["Child", "OUTPUT_GRACE_S", "collect"]

_CHUNK = 65536
OUTPUT_GRACE_S = 0.1


class Child(Protocol):
    """A running command: our ends of its pipes (fds), a way to kill it, its exit."""

    stdin: int
    stdout: int
    stderr: int

    def kill(self) -> None: ...
    def poll(self) -> int | None: ...
    async def wait(self) -> int: ...
    def close_pipes(self) -> None: ...


class _Sink:
    """One daemon thread that reads and drops what lingering output pipes still get, until EOF."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.lock = threading.Lock()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        threading.Thread(target=self._run, name="miles-env-output-sink", daemon=True).start()

    def adopt(self, fd: int) -> None:
        with self.lock:
            self.selector.register(fd, selectors.EVENT_READ)
        os.write(self.wake_w, b"x")

    def _run(self) -> None:
        while True:
            for key, _ in self.selector.select():
                try:
                    chunk = os.read(key.fd, _CHUNK)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if key.fd != self.wake_r and not chunk:
                    with self.lock:
                        self.selector.unregister(key.fd)
                    os.close(key.fd)


_sink: _Sink | None = None
_sink_lock = threading.Lock()


def _to_sink(fd: int) -> None:
    global _sink
    with _sink_lock:
        _sink = _sink or _Sink()
    _sink.adopt(fd)


@dataclass(slots=True)
class _Capture:
    cap: int
    data: bytearray = field(default_factory=bytearray)
    seen: int = 0
    eof: bool = False

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
            cap.eof = True
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
        if child.stdin >= 0:  # EOF for the command's stdin
            os.close(child.stdin)
            child.stdin = -1


async def _run(
    child: Child, stdin: bytes | None, out: _Capture, err: _Capture, limit: int, over: anyio.Event
) -> None:
    """Pump, feed and wait; after the command exits, its pipes get OUTPUT_GRACE_S to reach EOF."""
    async with anyio.create_task_group() as tg:

        async def watch_over() -> None:
            await over.wait()
            child.kill()

        async def pumps() -> None:
            async with anyio.create_task_group() as inner:
                inner.start_soon(_drain, child.stdout, out, limit, over)
                inner.start_soon(_drain, child.stderr, err, limit, over)
            done.set()

        done = anyio.Event()
        tg.start_soon(watch_over)
        tg.start_soon(_feed, child, stdin)
        tg.start_soon(pumps)
        await child.wait()
        with anyio.move_on_after(OUTPUT_GRACE_S):
            await done.wait()
        tg.cancel_scope.cancel()


async def collect(
    child: Child,
    *,
    stdin: bytes | None,
    timeout: float,
    output_cap: int,
    kill_factor: int = 4,
    start: float | None = None,
) -> RawResult:
    """Feed `stdin`, capture capped output and wait for the exit; a limit or a cancellation kills."""
    start = time.perf_counter() if start is None else start
    out, err = _Capture(output_cap), _Capture(output_cap)
    over = anyio.Event()
    timed_out = False
    try:
        with anyio.move_on_after(timeout if math.isfinite(timeout) else None) as scope:
            await _run(child, stdin, out, err, output_cap * kill_factor + _CHUNK, over)
        timed_out = scope.cancelled_caught
        if timed_out:
            child.kill()
            with anyio.move_on_after(OUTPUT_GRACE_S * 10):  # the tail of what it wrote, as it died
                await _run(child, None, out, err, 1 << 62, anyio.Event())
    finally:
        with anyio.CancelScope(shield=True):
            if child.poll() is None:
                child.kill()
            with anyio.move_on_after(30):
                await child.wait()
            _release(child, out, err)
    code = child.poll()
    return RawResult(
        returncode=128 + 9 if code is None else code,
        stdout=bytes(out.data),
        stderr=bytes(err.data),
        timed_out=timed_out,
        output_killed=over.is_set(),
        truncated=out.truncated or err.truncated,
        duration_s=time.perf_counter() - start,
    )


def _release(child: Child, out: _Capture, err: _Capture) -> None:
    """Close our ends; an output pipe that some background process still holds goes to the sink."""
    for name, cap in (("stdout", out), ("stderr", err)):
        fd = getattr(child, name)
        if fd >= 0 and not cap.eof:
            setattr(child, name, -1)
            _to_sink(fd)
    child.close_pipes()
