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
{"argv", "rlimits": [[resource, soft, hard], ...]}, with SCM_RIGHTS [stdin, stdout,
stderr, status]. No reply: the child gets a new session, the rlimits, the fds as
0/1/2/3, nothing else open, then execvp(argv); `argv` is a bwrap call with
`--json-status-fd 3`, so bwrap itself reports the sandbox's pid and exit code to us.
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


def _child(argv: list[str], rlimits: list[list[int]], fds: list[int]) -> None:
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
    sock = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps our children
    while (got := _receive(sock)) is not None:
        req, fds = got
        try:
            if os.fork() == 0:
                _child(list(req["argv"]), list(req["rlimits"]), fds)  # type: ignore[call-overload]
        except OSError as e:
            os.write(fds[2], f"zygote: fork failed: {e}\n".encode())
        finally:
            for fd in fds:
                os.close(fd)


if __name__ == "__main__":
    main()
