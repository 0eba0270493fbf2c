"""spawn(): a long-running process inside a local sandbox, with its stdin/stdout/stderr as pipes.

Concept: `exec()` runs a command to completion and returns its captured output; `spawn()`
starts the same command the same way (a fork of the sandbox's zygote, inside its namespaces,
with its limits, user and environment) and hands back a live `anyio.abc.Process`, so the caller
can speak a protocol over its pipes (a framework worker's stdio RPC). Its `pid` is the command's
host pid and its process group (killpg works from the host); there is no wall-clock limit here,
the caller owns the process's lifetime.

Lifecycle: spawn -> talk over the pipes -> the caller kills or waits for it -> `aclose()` or
`release()`; `sandbox.close()` kills it with the rest of the sandbox either way.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream, Process

from miles_env.errors import SandboxError
from miles_env.sandbox import Command

from .forkserver import ZygoteChild
from .sandbox import LocalSandbox

__all__ = ["spawn", "release"]


class _Receive(ByteReceiveStream):
    def __init__(self, child: ZygoteChild, name: str) -> None:
        self.child, self.name = child, name

    async def receive(self, max_bytes: int = 65536) -> bytes:
        while (fd := getattr(self.child, self.name)) >= 0:
            try:
                data = os.read(fd, max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(fd)
                continue
            if data:
                return data
            break
        raise anyio.EndOfStream

    async def aclose(self) -> None:
        _close(self.child, self.name)


class _Send(ByteSendStream):
    def __init__(self, child: ZygoteChild) -> None:
        self.child = child

    async def send(self, item: bytes) -> None:
        view = memoryview(item)
        while view:
            if self.child.stdin < 0:
                raise anyio.ClosedResourceError
            try:
                view = view[os.write(self.child.stdin, view) :]
            except BlockingIOError:
                await anyio.wait_writable(self.child.stdin)
            except BrokenPipeError as e:
                raise anyio.BrokenResourceError from e

    async def aclose(self) -> None:
        _close(self.child, "stdin")


def _close(child: ZygoteChild, name: str) -> None:
    fd = getattr(child, name)
    if fd >= 0:
        setattr(child, name, -1)
        os.close(fd)


class SandboxProcess(Process):
    """A command the zygote started in a sandbox, as an anyio Process."""

    def __init__(self, child: ZygoteChild) -> None:
        assert child.pid is not None
        self.child = child
        self._pid = child.pid
        self._stdin, self._stdout, self._stderr = (
            _Send(child),
            _Receive(child, "stdout"),
            _Receive(child, "stderr"),
        )

    async def wait(self) -> int:
        return await self.child.wait()

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.child.kill()

    def send_signal(self, sig: int) -> None:
        if self.child.poll() is None:
            try:
                os.kill(self._pid, sig)
            except ProcessLookupError:
                pass

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        self.child._read_status()
        return self.child.poll()

    @property
    def stdin(self) -> ByteSendStream:
        return self._stdin

    @property
    def stdout(self) -> ByteReceiveStream:
        return self._stdout

    @property
    def stderr(self) -> ByteReceiveStream:
        return self._stderr

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            if self.child.poll() is None:
                self.kill()
            await self.wait()
        self.child.close_pipes()


async def spawn(
    sandbox: LocalSandbox,
    cmd: Command,
    *,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Process:
    """Start `cmd` inside `sandbox` with piped stdin, stdout and stderr; its own session."""
    sandbox._check_open()
    await sandbox._apply_mounts()
    child, _ = sandbox.start_child(cmd, cwd=cwd, env=env)
    while child.pid is None and child.poll() is None:
        await anyio.wait_readable(child.status)
        child._read_status()
    if child.pid is None:
        child.close_pipes()
        raise SandboxError(f"sandbox {sandbox.id}: spawn {cmd!r}: {child.error or 'it did not start'}")
    return SandboxProcess(child)


def release(sandbox: LocalSandbox, process: Process) -> None:
    """Close what we still hold of an exited process spawned in `sandbox` (its pipes)."""
    if isinstance(process, SandboxProcess) and process.returncode is not None:
        process.child.close_pipes()
