"""The zygote: a tiny process that lives in a sandbox's pids cgroup and forks its execs.

Why: moving a process into a cgroup v1 (a write to cgroup.procs) takes the kernel's
global cgroup_threadgroup_rwsem for writing, which waits for an RCU grace period and
holds back every fork on the host meanwhile: ~0.3 ms on a busy host, ~10-20 ms on an
idle one (measured in bench/results/sandbox.md; /sys/kernel/rcu_expedited=1 makes it
vanish). A child forked by a process already inside the cgroup is in it from birth,
with no such write. So the zygote joins once and every exec is a plain fork; the
provider recycles zygote+cgroup pairs across sandboxes, so steady state has no join.

This file runs as a script with the host's python (stdlib only), not imported by us.
Protocol over a SOCK_SEQPACKET socket (fd argv[1]): one JSON request per packet,
{"argv", "rlimits": [[resource, soft, hard], ...], "netns": path | null, "ids": [uid,
gid] | null}, with SCM_RIGHTS [stdin, stdout, stderr, status]. No reply: the child gets
a new session, the rlimits, the fds as 0/1/2/3, nothing else open, joins `netns` (the
expose() bridge's network namespace; a join needs root, so before the next step), drops
to the host uid/gid `ids` with no supplementary groups (as root: the sandbox must never
be host root), then execvp(argv); `argv` is a bwrap call with `--json-status-fd 3`, so
bwrap itself reports the sandbox's pid and exit code to us.
A failed fork is written to the request's stderr. Children are reaped by the kernel
(SIGCHLD ignored). On EOF (our side closed or died) the zygote exits; bwrap's
--die-with-parent then kills each sandbox's processes.
"""

from __future__ import annotations

import array
import json
import os
import resource
import signal
import socket
import sys

_MAX_FDS = 4
_CLONE_NEWNET = 0x40000000
_libc = None  # ctypes' libc, loaded by the first request that joins a network namespace (os.setns is 3.12+)


def _setns(path: str) -> None:
    import ctypes  # loaded by main() before the fork: no import cost here

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:  # type: ignore[union-attr]
            raise OSError(ctypes.get_errno(), f"setns {path}")
    finally:
        os.close(fd)


def _child(
    argv: list[str], rlimits: list[list[int]], fds: list[int], netns: str | None, ids: list[int] | None
) -> None:
    try:
        # Python ignores SIGPIPE and SIGXFSZ at start-up, we ignore SIGCHLD, and an ignored signal
        # stays ignored across exec: restore them (else `yes | head` never ends, a file-size limit
        # is not reported, and bwrap could not wait for its child).
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        for res, soft, hard in rlimits:
            resource.setrlimit(res, (soft, hard))
        for target, fd in enumerate(fds):
            os.dup2(fd, target)  # dup2 clears close-on-exec on the target
        os.closerange(len(fds), os.sysconf("SC_OPEN_MAX"))
        if netns is not None:
            _setns(netns)
        if ids is not None:
            os.setgroups([])
            os.setresgid(ids[1], ids[1], ids[1])
            os.setresuid(ids[0], ids[0], ids[0])
        os.execvp(argv[0], argv)
    except BaseException as e:  # noqa: BLE001 - report any failure like a shell would, then die
        os.write(2, f"zygote: cannot run {argv[0]!r}: {e}\n".encode())
    finally:
        os._exit(127)


def _receive(sock: socket.socket) -> tuple[dict[str, object], list[int]] | None:
    fds = array.array("i")
    msg, ancdata, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(_MAX_FDS * fds.itemsize))
    if not msg:
        return None
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return json.loads(msg), list(fds)


def main() -> None:
    global _libc
    sock = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps our children
    while (got := _receive(sock)) is not None:
        req, fds = got
        netns, ids = req.get("netns"), req.get("ids")  # type: ignore[assignment]
        if netns is not None and _libc is None:
            import ctypes

            _libc = ctypes.CDLL(None, use_errno=True)
        try:
            if os.fork() == 0:
                _child(list(req["argv"]), list(req["rlimits"]), fds, netns, ids)  # type: ignore[call-overload, arg-type]
        except OSError as e:
            os.write(fds[2], f"zygote: fork failed: {e}\n".encode())
        finally:
            for fd in fds:
                os.close(fd)


if __name__ == "__main__":
    main()
