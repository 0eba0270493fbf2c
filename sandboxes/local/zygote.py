"""The zygote: a tiny process that lives in a sandbox's pids cgroup and forks its execs.

Why: moving a process into a cgroup v1 (a write to cgroup.procs) takes the kernel's
global cgroup_threadgroup_rwsem for writing, which waits for an RCU grace period and
holds back every fork on the host meanwhile: ~0.3 ms on a busy host, ~10-20 ms on an
idle one (measured in bench/results/sandbox.md; /sys/kernel/rcu_expedited=1 makes it
vanish). A child forked by a process already inside the cgroup is in it from birth,
with no such write. So the zygote joins once and every exec is a plain fork; the
provider recycles zygote+cgroup pairs across sandboxes, so steady state has no join.

This file runs as a script with the host's python (stdlib only), not imported by us.
Protocol over a SOCK_SEQPACKET socket (fd argv[1]), one JSON message per packet:
  request {"id", "argv", "rlimits": [[resource, soft, hard], ...]} + SCM_RIGHTS
          [stdin, stdout, stderr] -> reply {"id", "pid"} or {"id", "error"}
  later   {"exit": pid, "code": exit code, negative for a signal (as subprocess)}
The child: new session, the rlimits, the three fds as 0/1/2, nothing else open, then
execvp(argv). On EOF (our side closed or died) the zygote kills its children's
process groups and exits.
"""

from __future__ import annotations

import array
import json
import os
import resource
import selectors
import signal
import socket
import sys

_MAX_FDS = 3


def _child(argv: list[str], rlimits: list[list[int]], fds: list[int]) -> None:
    try:
        # Python ignores these at start-up and an ignored signal stays ignored across exec:
        # restore them, or `yes | head` never ends and a file-size limit is not reported.
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        for res, soft, hard in rlimits:
            resource.setrlimit(res, (soft, hard))
        for target, fd in enumerate(fds):
            os.dup2(fd, target)  # dup2 clears close-on-exec on the target
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
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
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, None)
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        for key, _ in sel.select():
            if key.data is None:
                got = _receive(sock)
                if got is None:
                    for pid in children.values():
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except OSError:
                            pass
                    return
                req, fds = got
                try:
                    pid = os.fork()
                    if pid == 0:
                        _child(list(req["argv"]), list(req["rlimits"]), fds)  # type: ignore[call-overload]
                    pidfd = os.pidfd_open(pid)
                    children[pidfd] = pid
                    sel.register(pidfd, selectors.EVENT_READ, pid)
                    reply: dict[str, object] = {"id": req["id"], "pid": pid}
                except OSError as e:
                    reply = {"id": req["id"], "error": str(e)}
                finally:
                    for fd in fds:
                        os.close(fd)
                sock.send(json.dumps(reply).encode())
            else:
                pidfd = key.fd
                sel.unregister(pidfd)
                os.close(pidfd)
                pid = children.pop(pidfd)
                _, status = os.waitpid(pid, 0)
                sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


if __name__ == "__main__":
    main()
