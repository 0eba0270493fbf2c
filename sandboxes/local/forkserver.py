"""Host side of the zygote (zygote.py says why it exists): start one, ask it to fork execs.

Lifecycle: `start_zygote(python, cgroup)` launches `zygote.py` through a shell that
first writes its own pid into the cgroup (the one join), over a SOCK_SEQPACKET pair.
`spawn(argv, res)` hands it the argv, the rlimits and the child's ends of three pipes,
and returns a ZygoteChild whose `wait()` resolves from the zygote's exit message (the
child is the zygote's, not ours, so only the zygote can reap it). `close()` (sync)
closes the socket, on which the zygote kills its children and exits, then reaps it.

Not bound to an event loop: the socket is non-blocking and read with anyio.wait_readable
under a lock, so a provider can keep idle zygotes across `anyio.run` calls.
"""

from __future__ import annotations

import array
import json
import os
import resource
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.lowlevel

from miles_env.errors import SandboxError
from miles_env.types import Resources

from .cgroup import PidsCgroup

__all__ = ["Zygote", "ZygoteChild", "start_zygote"]

_SCRIPT = Path(__file__).with_name("zygote.py")


def rlimits(res: Resources, *, nproc: bool = False) -> list[list[int]]:
    """The exec's rlimits. CPU soft < hard, so SIGXCPU names the cause before a SIGKILL would."""
    out = [
        [resource.RLIMIT_CPU, res.cpu_seconds, res.cpu_seconds + 1],
        [resource.RLIMIT_AS, res.memory_mb << 20, res.memory_mb << 20],
        [resource.RLIMIT_FSIZE, res.disk_mb << 20, res.disk_mb << 20],
        [resource.RLIMIT_CORE, 0, 0],
    ]
    if nproc:
        out.append([resource.RLIMIT_NPROC, res.max_procs, res.max_procs])
    return out


@dataclass(slots=True)
class ZygoteChild:
    """An exec forked by a zygote: our ends of its pipes, and its exit code once known."""

    zygote: Zygote
    pid: int
    stdin: int
    stdout: int
    stderr: int
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exits.pop(self.pid, None)
        return self.returncode

    async def wait(self) -> int:
        await self.zygote.read_until(lambda: self.poll() is not None)
        assert self.returncode is not None
        return self.returncode

    def close_pipes(self) -> None:
        for name in ("stdin", "stdout", "stderr"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


@dataclass(slots=True)
class Zygote:
    process: subprocess.Popen[bytes]
    sock: socket.socket
    cgroup: PidsCgroup | None
    exits: dict[int, int] = field(default_factory=dict)  # pid -> exit code, until its child polls
    replies: dict[int, dict[str, object]] = field(default_factory=dict)
    next_id: int = 0
    lock: anyio.Lock | None = None
    lock_token: object = None

    @property
    def pid(self) -> int:
        return self.process.pid

    async def read_until(self, done: Callable[[], bool]) -> None:
        """Read and file messages until `done()`; one reader at a time, the others re-check first."""
        token = anyio.lowlevel.current_token()
        if self.lock is None or self.lock_token is not token:  # a new event loop (anyio.run)
            self.lock, self.lock_token = anyio.Lock(), token
        async with self.lock:
            while not done():
                try:
                    data = self.sock.recv(1 << 16)
                except BlockingIOError:
                    await anyio.wait_readable(self.sock)
                    continue
                except OSError as e:
                    raise SandboxError(f"the sandbox's zygote (pid {self.pid}) is gone: {e}") from e
                if not data:
                    raise SandboxError(f"the sandbox's zygote (pid {self.pid}) exited")
                msg = json.loads(data)
                if "exit" in msg:
                    self.exits[int(msg["exit"])] = int(msg["code"])
                else:
                    self.replies[int(msg["id"])] = msg

    async def spawn(self, argv: list[str], res: Resources, *, nproc: bool = False) -> ZygoteChild:
        """Fork `argv` from the zygote with `res`'s rlimits, stdin/stdout/stderr piped to us."""
        pipes = [os.pipe() for _ in range(3)]  # (read, write) each
        ours = [pipes[0][1], pipes[1][0], pipes[2][0]]
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1]]
        request_id, self.next_id = self.next_id, self.next_id + 1
        payload = json.dumps({"id": request_id, "argv": argv, "rlimits": rlimits(res, nproc=nproc)}).encode()
        try:
            fds = array.array("i", theirs)
            self.sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
        except OSError as e:
            for fd in ours:
                os.close(fd)
            raise SandboxError(f"the sandbox's zygote (pid {self.pid}) is gone: {e}") from e
        finally:
            for fd in theirs:
                os.close(fd)
        for fd in ours:
            os.set_blocking(fd, False)
        try:
            await self.read_until(lambda: request_id in self.replies)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        reply = self.replies.pop(request_id)
        if "error" in reply:
            for fd in ours:
                os.close(fd)
            raise SandboxError(f"exec: the sandbox's zygote could not fork: {reply['error']}")
        return ZygoteChild(self, int(reply["pid"]), *ours)  # type: ignore[call-overload]

    def close(self) -> None:
        """Close the socket: the zygote kills its children and exits; reap it."""
        self.sock.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_zygote(python: str, cgroup: PidsCgroup | None) -> Zygote:
    """Start a zygote that has joined `cgroup` before it forks anything."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    join = 'echo $$ > "$0" || exit 125; ' if cgroup is not None else ""
    argv = ["/bin/sh", "-c", join + 'exec "$@"', cgroup.procs_file if cgroup else "sh"]
    argv += [python, "-S", "-E", str(_SCRIPT), str(theirs.fileno())]
    try:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(theirs.fileno(),)
        )
    finally:
        theirs.close()
    ours.setblocking(False)
    return Zygote(process, ours, cgroup)
