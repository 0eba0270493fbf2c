"""Host side of the zygote (zygote.py says why it exists): start one, ask it to fork execs.

Lifecycle: `start_zygote(python, cgroup)` launches `zygote.py` through a shell that
first writes its own pid into the cgroup (the one join), over a SOCK_SEQPACKET pair.
`spawn(argv, res, netns=, ids=)` sends a bwrap argv (with `--json-status-fd 3`), the
rlimits, the network namespace to join and the host uid/gid to run as, and the child's
ends of four pipes, and returns at once a ZygoteChild: its exit code and the
sandbox's pid come from bwrap's status pipe, so no reply from the zygote is awaited
(each cross-process wake-up costs ~0.2-0.5 ms on these VMs). `close()` (sync) closes
the socket, on which the zygote exits, and reaps it.
"""

from __future__ import annotations

import array
import errno
import json
import os
import resource
import shlex
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import anyio

from miles_env.errors import SandboxError
from miles_env.types import Resources

from .cgroup import PidsCgroup

__all__ = ["RequestTooLarge", "Zygote", "ZygoteChild", "start_zygote"]

_SCRIPT = Path(__file__).with_name("zygote.py")


class RequestTooLarge(Exception):
    """An exec whose argv and environment do not fit in one zygote message."""


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
    """An exec forked by a zygote: our ends of its pipes; bwrap's status pipe tells pid and exit."""

    stdin: int
    stdout: int
    stderr: int
    status: int
    sandbox_pid: int | None = None  # bwrap's child: pid 1 of the exec's pid namespace
    exit_code: int | None = None  # from bwrap, before it has exited
    returncode: int | None = None  # once bwrap has exited
    kill_pending: bool = False
    _buf: bytes = b""

    def _read_status(self) -> bool:
        """Parse what bwrap wrote so far; True at EOF (bwrap exited, returncode set)."""
        eof = False
        while True:
            try:
                data = os.read(self.status, 4096)
            except BlockingIOError:
                break
            if not data:
                eof = True
                break
            self._buf += data
        # bwrap writes one JSON object per line: {"child-pid": ...} at start, {"exit-code": ...} at the end.
        *lines, self._buf = self._buf.split(b"\n")
        if eof and self._buf.strip():
            lines.append(self._buf)
        for line in lines:
            msg = json.loads(line) if line.strip() else {}
            if "child-pid" in msg:
                self.sandbox_pid = int(msg["child-pid"])
            if "exit-code" in msg:
                self.exit_code = int(msg["exit-code"])
        if eof:
            # No exit code: bwrap failed before running the command; its stderr says why.
            self.returncode = self.exit_code if self.exit_code is not None else 1
        return eof

    def kill(self) -> None:
        if self.returncode is None and self.sandbox_pid is None:
            self._read_status()
        if self.sandbox_pid is None:
            self.kill_pending = True  # bwrap has not started the sandbox yet: kill it when it has
            return
        try:
            os.kill(self.sandbox_pid, signal.SIGKILL)  # pid 1 of the namespace: all of it dies
        except ProcessLookupError:
            pass

    def poll(self) -> int | None:
        return self.returncode

    async def wait(self) -> int:
        while not self._read_status():
            if self.kill_pending and self.sandbox_pid is not None:
                self.kill_pending = False
                self.kill()
            await anyio.wait_readable(self.status)
        assert self.returncode is not None
        return self.returncode

    def close_pipes(self) -> None:
        for name in ("stdin", "stdout", "stderr", "status"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


@dataclass(slots=True)
class Zygote:
    process: subprocess.Popen[bytes]
    sock: socket.socket
    cgroup: PidsCgroup | None

    @property
    def pid(self) -> int:
        return self.process.pid

    def spawn(
        self,
        argv: list[str],
        res: Resources,
        *,
        nproc: bool = False,
        netns: str | None = None,
        ids: tuple[int, int] | None = None,
    ) -> ZygoteChild:
        """Have the zygote fork `argv` (a bwrap call, given `--json-status-fd 3` here) under `res`,
        in network namespace `netns` (a /proc/PID/ns/net path) and as host uid/gid `ids`."""
        argv = [argv[0], "--json-status-fd", "3", *argv[1:]]
        pipes = [os.pipe() for _ in range(4)]  # (read, write) each
        ours = [pipes[0][1], pipes[1][0], pipes[2][0], pipes[3][0]]
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
        request = {"argv": argv, "rlimits": rlimits(res, nproc=nproc), "netns": netns, "ids": ids}
        payload = json.dumps(request).encode()
        try:
            fds = array.array("i", theirs)
            self.sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
        except OSError as e:
            for fd in ours:
                os.close(fd)
            if e.errno == errno.EMSGSIZE:  # over the socket's buffer (~200 KB): the caller spawns it itself
                raise RequestTooLarge(f"{len(payload)} bytes of argv and environment") from e
            raise SandboxError(f"the sandbox's zygote (pid {self.pid}) is gone: {e}") from e
        finally:
            for fd in theirs:
                os.close(fd)
        for fd in ours:
            os.set_blocking(fd, False)
        return ZygoteChild(stdin=ours[0], stdout=ours[1], stderr=ours[2], status=ours[3])

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
    joins = [f"echo $$ > {shlex.quote(f)}" for f in (cgroup.procs_files if cgroup else [])]
    join = " && ".join(joins) + " || exit 125; " if joins else ""
    argv = ["/bin/sh", "-c", join + 'exec "$@"', "sh"]
    argv += [python, "-S", "-E", str(_SCRIPT), str(theirs.fileno())]
    try:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(theirs.fileno(),)
        )
    finally:
        theirs.close()
    ours.setblocking(False)
    return Zygote(process, ours, cgroup)
