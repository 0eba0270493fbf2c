"""Host side of the zygote (zygote.py says what it is): start one, talk to it, follow its execs.

Lifecycle: `start_zygote(python, cgroup, ids)` launches `zygote.py` through a shell that first
writes its own pid into the cgroup (the one join), over a SOCK_SEQPACKET pair; the zygote keeps
the host ids `ids` (uid, span) for every sandbox it runs. `await start(...)` makes its sandbox;
`spawn(...)` sends an exec and returns at once a ZygoteChild (our ends of its pipes; its host
pid and exit status arrive on the status pipe, so no reply is awaited before it runs);
`await listen(port)`, `await netns()`, `await mount(...)`, `await stop()`; `close()` (sync) closes the socket, on
which the zygote stops its sandbox and exits, and reaps it. Every answer comes on a pipe made
for that request and is awaited with anyio.wait_readable, so no call blocks the event loop.
"""

from __future__ import annotations

import array
import json
import os
import resource
import shlex
import signal
import socket
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from miles_env.errors import SandboxError
from miles_env.types import Resources

from .cgroup import PidsCgroup

__all__ = ["Zygote", "ZygoteChild", "kill_session", "rlimits", "start_zygote"]

_SCRIPT = Path(__file__).with_name("zygote.py")
# The zygote's environment: none of ours (each exec brings its own); a python that needs its
# LD_LIBRARY_PATH to start keeps it.
_ZYGOTE_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
_PACKET_MAX = 60_000  # a bigger request travels in a memfd (the zygote reads 64 KiB packets)


def rlimits(res: Resources, *, nproc: bool = False, fsize: bool = True) -> list[list[int]]:
    """The exec's rlimits. CPU soft < hard, so SIGXCPU names the cause before a SIGKILL would.
    `fsize`: cap each file at disk_mb, where no quota bounds the total (no root); a sandbox on its
    own tmpfs needs none, and a sparse file bigger than the disk (a test's "it cannot fit") works
    there as in a container."""
    out = [
        [resource.RLIMIT_CPU, res.cpu_seconds, res.cpu_seconds + 1],
        [resource.RLIMIT_AS, res.memory_mb << 20, res.memory_mb << 20],
        [resource.RLIMIT_CORE, 0, 0],
    ]
    if fsize:
        out.append([resource.RLIMIT_FSIZE, res.disk_mb << 20, res.disk_mb << 20])
    if nproc:
        out.append([resource.RLIMIT_NPROC, res.max_procs, res.max_procs])
    return out


def _session_of(pid: int) -> int | None:
    """The session id of host pid `pid` (None once it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else int(fields[3])


def kill_session(sid: int, members: Callable[[], list[int]], rounds: int = 20) -> None:
    """SIGKILL every process of session `sid` among `members()` (host pids), until none is left."""
    for _ in range(rounds):
        hit = [pid for pid in members() if _session_of(pid) == sid]
        if not hit:
            return
        for pid in hit:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def all_pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


class _Lines:
    """JSON objects, one per line, from a non-blocking pipe."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf, self.eof = fd, b"", False

    def read_ready(self) -> list[dict[str, Any]]:
        """What has arrived so far (non-blocking); sets `eof` at the end."""
        while not self.eof:
            try:
                chunk = os.read(self.fd, 4096)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
            self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        if self.eof and self.buf.strip():
            lines, self.buf = [*lines, self.buf], b""
        return [json.loads(line) for line in lines if line.strip()]

    async def next(self) -> dict[str, Any] | None:
        pending: list[dict[str, Any]] = []
        while not (pending := pending or self.read_ready()) and not self.eof:
            await anyio.wait_readable(self.fd)
        return pending[0] if pending else None


@dataclass(slots=True)
class ZygoteChild:
    """An exec the zygote forked: our ends of its pipes; the status pipe tells its pid and exit."""

    stdin: int
    stdout: int
    stderr: int
    status: int
    members: Callable[[], list[int]]  # host pids that may belong to it (its cgroup's, or all)
    pid: int | None = None  # the command's host pid: its session id
    returncode: int | None = None
    error: str | None = None  # the zygote could not start it
    kill_pending: bool = False
    _lines: _Lines | None = None
    _early: list[dict[str, Any]] = field(default_factory=list)

    def _read_status(self) -> None:
        lines = self._lines = self._lines or _Lines(self.status)
        for msg in lines.read_ready():
            if "child-pid" in msg:
                self.pid = int(msg["child-pid"])
            elif "exit-code" in msg:
                self.returncode = int(msg["exit-code"])
            elif "error" in msg:
                self.error = str(msg["error"])
        if lines.eof and self.returncode is None:
            if self.pid is None and self.error is None:
                # Not a word: the request sat in the socket when the zygote died, and went with it.
                # Exit 137 here (as before) read as the command killed, i.e. the policy's own end.
                self.error = "the sandbox's zygote is gone: the exec was never started"
            self.returncode = 128 + signal.SIGKILL if self.error is None else 126

    def kill(self) -> None:
        """Kill the command and everything of its session (background jobs it left are not spared)."""
        if self.returncode is None:
            self._read_status()
        if self.returncode is not None and self.pid is None:
            return
        if self.pid is None:
            self.kill_pending = True  # not forked yet: kill it once its pid arrives
            return
        kill_session(self.pid, self.members)

    def poll(self) -> int | None:
        return self.returncode

    def exited(self) -> int | None:
        """Its exit status if it has ended (reads what the status pipe has so far), else None."""
        if self.returncode is None:
            self._read_status()
        return self.returncode

    async def wait(self) -> int:
        self._read_status()
        while self.returncode is None:
            if self.kill_pending and self.pid is not None:
                self.kill_pending = False
                self.kill()
            await anyio.wait_readable(self.status)
            self._read_status()
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
    ids: tuple[int, int]  # (host uid of the sandboxes' root, how many ids they have)

    @property
    def pid(self) -> int:
        return self.process.pid

    def _send(self, request: dict[str, Any], fds: list[int]) -> None:
        payload = json.dumps(request).encode()
        memfd = -1
        if len(payload) > _PACKET_MAX:
            memfd = os.memfd_create("miles-env-request", os.MFD_CLOEXEC)
            os.write(memfd, payload)
            os.lseek(memfd, 0, os.SEEK_SET)
            payload, fds = (
                json.dumps({"op": request["op"], "memfd": True}).encode(),
                [*fds[:-1], memfd, fds[-1]],
            )
        try:
            self.sock.sendmsg(
                [payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
            )
        except OSError as e:
            raise SandboxError(f"the sandbox's zygote (pid {self.pid}) is gone: {e}") from e
        finally:
            if memfd >= 0:
                os.close(memfd)

    async def _ask(self, request: dict[str, Any], fds: Sequence[int] = ()) -> dict[str, Any]:
        """Send `request` with `fds` (closed here) and an answer pipe; the first answer line."""
        answer_r, answer_w = os.pipe()
        os.set_blocking(answer_r, False)
        try:
            try:
                self._send(request, [*fds, answer_w])
            finally:
                for fd in (*fds, answer_w):
                    os.close(fd)
            got = await _Lines(answer_r).next()
        finally:
            os.close(answer_r)
        if got is None:
            raise SandboxError(f"the sandbox's zygote (pid {self.pid}) did not answer {request['op']!r}")
        return got

    async def start(
        self,
        bwrap: str,
        options: list[str],
        idmap: tuple[str, str] | None,
        slirp4netns: str | None = None,
        netns: int | None = None,
    ) -> int:
        """Make the sandbox (with `slirp4netns`: and its network, network.py; with `netns`, an fd
        closed here: in that network namespace, another sandbox's, instead of a new one); its
        init's host pid. A failure raises with bwrap's (or slirp4netns's) own words."""
        request = {
            "op": "start",
            "bwrap": bwrap,
            "options": options,
            "idmap": idmap,
            "slirp4netns": slirp4netns,
            "netns": netns is not None,
        }
        got = await self._ask(request, [] if netns is None else [netns])
        if "init" not in got:
            raise SandboxError(f"starting the sandbox: {got.get('error')}")
        return int(got["init"])

    def spawn(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        ids: tuple[int, int, tuple[int, ...]],
        limits: list[list[int]],
        members: Callable[[], list[int]],
    ) -> ZygoteChild:
        """Have the zygote run `argv` in its sandbox (as inner ids `ids`, with `limits`)."""
        pipes = [os.pipe() for _ in range(4)]  # (read, write) each
        ours = [pipes[0][1], pipes[1][0], pipes[2][0], pipes[3][0]]
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
        uid, gid, groups = ids
        request = {"op": "exec", "argv": argv, "env": env, "cwd": cwd, "ids": [uid, gid, list(groups)]}
        request["rlimits"] = limits
        try:
            self._send(request, theirs)
        except SandboxError:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        for fd in ours:
            os.set_blocking(fd, False)
        return ZygoteChild(ours[0], ours[1], ours[2], ours[3], members)

    async def listen(self, port: int) -> tuple[socket.socket, int]:
        """A listening TCP socket on the sandbox's 127.0.0.1 (`port`, or one from 20000 if taken)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours:
            ours.setblocking(False)
            try:
                self._send({"op": "listen", "port": port}, [theirs.fileno()])
            finally:
                theirs.close()
            await anyio.wait_readable(ours)
            msg, fds, _, _ = socket.recv_fds(ours, 4096, 1)
        got = json.loads(msg) if msg else {"error": "no answer"}
        if not fds:
            raise SandboxError(f"expose: no listening socket in the sandbox: {got.get('error')}")
        return socket.socket(fileno=fds[0]), int(got["port"])

    async def netns(self) -> int:
        """An fd of the running sandbox's network namespace (the caller closes it): for a sidecar."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours:
            ours.setblocking(False)
            try:
                self._send({"op": "netns"}, [theirs.fileno()])
            finally:
                theirs.close()
            await anyio.wait_readable(ours)
            msg, fds, _, _ = socket.recv_fds(ours, 4096, 1)
        if not fds:
            got = json.loads(msg) if msg else {"error": "no answer"}
            raise SandboxError(f"the sandbox's network namespace: {got.get('error')}")
        return fds[0]

    async def mount(self, source: str, target: str) -> None:
        got = await self._ask({"op": "mount", "source": source, "target": target})
        if not got.get("ok"):
            raise SandboxError(f"mount_ro({source!r}, {target!r}): {got.get('error')}")

    async def stop(self) -> bool:
        """End the running sandbox (all its processes); True once its init is gone."""
        return bool((await self._ask({"op": "stop"})).get("stopped"))

    def close(self) -> None:
        """Close the socket: the zygote stops its sandbox and exits; reap it."""
        self.sock.close()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_zygote(python: str, cgroup: PidsCgroup | None, ids: tuple[int, int]) -> Zygote:
    """Start a zygote that has joined `cgroup` before it forks anything; its sandboxes get `ids`."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    joins = [f"echo $$ > {shlex.quote(f)}" for f in (cgroup.procs_files if cgroup else [])]
    join = " && ".join(joins) + " || exit 125; " if joins else ""
    argv = ["/bin/sh", "-c", join + 'exec "$@"', "sh"]
    procs = cgroup.procs_file if cgroup else ""
    argv += [python, "-S", "-E", str(_SCRIPT), str(theirs.fileno()), str(ids[0]), str(ids[1]), procs]
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            pass_fds=(theirs.fileno(),),
            env={**_ZYGOTE_ENV, **{k: v for k, v in os.environ.items() if k == "LD_LIBRARY_PATH"}},
        )
    finally:
        theirs.close()
    return Zygote(process, ours, cgroup, ids)  # blocking sends: the zygote drains its queue at once
