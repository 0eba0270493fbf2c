"""Exec processes started ahead of time, so joining the pids cgroup is off the exec path.

Why: moving a process into a cgroup v1 (a write to cgroup.procs) takes the kernel's
global cgroup_threadgroup_rwsem for writing, which waits for an RCU grace period:
~0.3 ms on a busy host but ~10 ms on an idle one, where it made one exec 2-3x a bare
bwrap call (bench/results/sandbox.md; confirmed by /sys/kernel/rcu_expedited=1
making it vanish). The wait is latency, not work, so it can overlap other work.

Concept: a Spare is `bwrap --args FD -- /bin/sh -c TRAMPOLINE` started before it
is needed. bwrap blocks reading its options (NUL-separated) from a pipe while a
daemon thread moves it into the sandbox's pids cgroup. `launch()` waits until that
is done, sets the command's rlimits on the pid (prlimit), writes the options and
closes the pipe; from then on it is an ordinary child process whose output
process.collect() gathers. bwrap ignores a command inside --args, so the command
travels as one shell-quoted variable that the trampoline unsets and `exec`s: one
extra exec of /bin/sh inside the sandbox (~0.3 ms), against ~10 ms of waiting.

Invariants: a spare receives its argv only after it is in the cgroup and its
rlimits are set, so every process of the command is counted and limited. A spare
that is never launched exits by itself when its pipe closes (bwrap: no command),
including when this process dies. Every spare's pid is in the sandbox's `live`
set from its start, so close() kills it like any running command.
"""

from __future__ import annotations

import os
import resource
import shlex
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio

from miles_env.errors import SandboxError
from miles_env.types import Resources

from .cgroup import PidsCgroup
from .process import Popen, kill_group, reap, spawn

__all__ = ["ARGV_VAR", "Spare", "drop_spare", "drop_spare_now", "start_spare", "trampoline_env"]

ARGV_VAR = "MILES_ENV_ARGV"
# The command's own environment does not keep ARGV_VAR: `a` is an unexported shell variable.
_TRAMPOLINE = f'a=${ARGV_VAR}; unset {ARGV_VAR}; eval "exec $a"'


def trampoline_env(argv: Sequence[str]) -> list[str]:
    """The bwrap options that hand `argv` to the trampoline."""
    return ["--setenv", ARGV_VAR, shlex.join(argv)]


@dataclass(slots=True)
class Spare:
    process: Popen[bytes]
    outer: tuple[str, ...]  # argv before bwrap (e.g. nsenter into the expose() netns)
    args_fd: int  # write end of the pipe bwrap reads its argv from
    joined: threading.Event = field(default_factory=threading.Event)
    join_error: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    async def launch(self, options: Sequence[str], res: Resources, *, nproc: bool) -> None:
        """Make the spare run with bwrap `options` (incl. trampoline_env(argv)) under `res`'s limits."""
        if not self.joined.is_set():
            await anyio.to_thread.run_sync(self.joined.wait)
        if self.join_error is not None:
            self.discard()
            raise SandboxError(f"exec: could not join the sandbox's pids cgroup: {self.join_error}")
        try:
            _set_rlimits(self.pid, res, nproc=nproc)
            data = b"".join(a.encode() + b"\0" for a in options)
            view = memoryview(data)
            while view:  # bwrap is blocked reading this pipe, so a long argv cannot deadlock
                view = view[os.write(self.args_fd, view) :]
        except OSError as e:
            raise SandboxError(f"exec: the prepared bwrap process (pid {self.pid}) is gone: {e}") from e
        finally:
            self.discard()

    def discard(self) -> None:
        """Close our end of the argv pipe: launched, or (if not yet) the spare exits on EOF."""
        if self.args_fd >= 0:
            os.close(self.args_fd)
            self.args_fd = -1


def _set_rlimits(pid: int, res: Resources, *, nproc: bool) -> None:
    # CPU: soft < hard, so the kernel's SIGXCPU names the cause before our SIGKILL would.
    resource.prlimit(pid, resource.RLIMIT_CPU, (res.cpu_seconds, res.cpu_seconds + 1))
    resource.prlimit(pid, resource.RLIMIT_AS, (res.memory_mb << 20, res.memory_mb << 20))
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (res.disk_mb << 20, res.disk_mb << 20))
    resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
    if nproc:  # only without a pids cgroup: RLIMIT_NPROC does not bind root
        resource.prlimit(pid, resource.RLIMIT_NPROC, (res.max_procs, res.max_procs))


def _join(spare: Spare, cgroup: PidsCgroup) -> None:
    try:
        with open(cgroup.procs_file, "w") as f:
            f.write(str(spare.pid))
    except OSError as e:
        spare.join_error = str(e)
    finally:
        spare.joined.set()


def start_spare(bwrap: str, outer: Sequence[str], cgroup: PidsCgroup | None, live: set[int]) -> Spare:
    """Start `[*outer, bwrap, --args FD, --, sh, -c, TRAMPOLINE]`; it joins `cgroup` in the background.

    Synchronous (one fork+exec) and bound to no event loop: a provider keeps spares between loops.
    """
    read_fd, write_fd = os.pipe()
    try:
        process = spawn(
            [*outer, bwrap, "--args", str(read_fd), "--", "/bin/sh", "-c", _TRAMPOLINE], pass_fds=(read_fd,)
        )
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    live.add(process.pid)
    spare = Spare(process, tuple(outer), write_fd)
    if cgroup is None:
        spare.joined.set()
    else:
        threading.Thread(
            target=_join, args=(spare, cgroup), name="miles-env:cgroup-join", daemon=True
        ).start()
    return spare


async def drop_spare(spare: Spare, live: set[int]) -> None:
    """Kill an unused spare and reap it."""
    spare.discard()
    kill_group(spare.process)
    with anyio.CancelScope(shield=True):
        await reap(spare.process)
    live.discard(spare.pid)


def drop_spare_now(spare: Spare) -> None:
    """drop_spare() without an event loop (finalizers, interpreter exit)."""
    spare.discard()
    kill_group(spare.process)
    spare.process.wait()
    for pipe in (spare.process.stdin, spare.process.stdout, spare.process.stderr):
        if pipe is not None:
            pipe.close()
