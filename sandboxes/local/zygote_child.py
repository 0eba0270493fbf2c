"""What the zygote's forked children do in its running sandbox: run a command, listen, mount.

Stdlib only, imported by zygote.py (its sibling). Each function runs in a fresh fork of the
zygote, is handed the zygote, the request and its fds (the last one the answer's), and ends
the process; a failure before the answer is given is answered by the zygote's fork().

exec: the child enters the sandbox (namespaces.enter: the sandbox's host uid, its user, mount,
pid, net, ipc, uts and cgroup namespaces) and forks the command, which is then inside the pid
namespace: pid N there, its orphans adopted by the sandbox's init, killed with the sandbox. The
command gets a new session (its host pid is the session id a timeout kills by), the rlimits, its
stdio, nothing else open, no capability (namespaces.drop_to) and the image user's ids, then
execs with exactly the request's environment. The child stays outside the pid namespace (no
process inside can see or signal it), waits, and answers the exit status.
"""

from __future__ import annotations

import array
import errno
import fcntl
import json
import os
import resource
import signal
import socket
from typing import Any

import namespaces as nsx  # type: ignore[import-not-found]

__all__ = ["cannot_fork", "exec", "listen", "mount"]

_INNER_PORTS = range(20000, 21000)  # where a port that is taken inside is served instead


def _answer(fd: int, msg: dict[str, Any]) -> None:
    try:
        os.write(fd, json.dumps(msg).encode() + b"\n")
    except OSError:
        pass


def _command(req: dict[str, Any], stdio: list[int]) -> None:
    """In the sandbox's pid namespace: become the command. Never returns."""
    argv = [str(a) for a in req["argv"]]
    try:
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD):  # ignored by python/zygote
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        for res, soft, hard in req["rlimits"]:
            resource.setrlimit(res, (soft, hard))
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in stdio]  # no source clobbered
        for target, fd in enumerate(high):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        uid, gid, groups = req["ids"]
        nsx.drop_to(uid, gid, groups)
    except BaseException as e:  # noqa: BLE001
        os.write(2, f"miles-env: cannot start {argv[0]!r} in the sandbox: {e}\n".encode())
        os._exit(126)
    try:
        os.chdir(req["cwd"])
    except OSError as e:
        os.write(2, f"miles-env: cannot chdir to {req['cwd']}: {e.strerror}\n".encode())
        os._exit(126)
    try:
        os.execvpe(argv[0], argv, req["env"])
    except OSError as e:
        os.write(2, f"{argv[0]}: {e.strerror}\n".encode())
        os._exit(127 if e.errno in (errno.ENOENT, errno.ENOTDIR) else 126)
    finally:
        os._exit(127)


def exec(zygote: Any, req: dict[str, Any], fds: list[int]) -> None:  # noqa: A001 - the request's name
    stdio, answer = fds[:3], fds[3]
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # we wait for the command ourselves
    assert zygote.userns is not None and zygote.ns, "no sandbox is running"
    zygote.close_for_child([*fds, zygote.userns.outer, zygote.userns.inner, *zygote.ns.values()])
    nsx.enter(zygote.userns, zygote.ns, foreign_net=zygote.shared_net)
    try:
        pid = os.fork()
    except OSError as e:
        if e.errno == errno.ENOMEM:  # what fork into a pid namespace whose init is gone says
            _answer(answer, {"error": "cannot start a process in the sandbox: its init has exited"})
        else:  # EAGAIN: the sandbox's process limit, as a shell reports it
            cannot_fork(stdio[2], answer, e)
        return
    if pid == 0:
        _command(req, stdio)
    for fd in stdio:
        os.close(fd)
    _answer(answer, {"child-pid": pid})
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    _answer(answer, {"exit-code": 128 - code if code < 0 else code})


def cannot_fork(stderr: int, answer: int, e: OSError) -> None:
    """A fork refused (the pids cgroup, RLIMIT_NPROC): the exec's own result, not a broken sandbox."""
    os.write(stderr, f"miles-env: cannot fork: {e.strerror}\n".encode())
    _answer(answer, {"exit-code": 126})


def _bind(port: int) -> socket.socket:
    for candidate in (port, *_INNER_PORTS):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", candidate))
            sock.listen(128)
            return sock
        except OSError as e:
            sock.close()
            if e.errno != errno.EADDRINUSE:
                raise
    raise OSError(errno.EADDRINUSE, f"no free port for {port} inside the sandbox")


def listen(zygote: Any, req: dict[str, Any], fds: list[int]) -> None:
    """A listening socket on the sandbox's 127.0.0.1 (its network namespace), sent back as an fd."""
    answer = fds[-1]
    zygote.close_for_child([answer, zygote.userns.outer, zygote.ns["net"]])
    zygote.become_host_uid()
    nsx.join(zygote.userns.outer, nsx.CLONE_NEWUSER, "user")  # the net namespace's owner: bind any port
    nsx.join(zygote.ns["net"], nsx.CLONE_NEWNET, "net")
    sock = _bind(int(req["port"]))
    payload = json.dumps({"port": sock.getsockname()[1]}).encode() + b"\n"
    fd = array.array("i", [sock.fileno()]).tobytes()
    socket.socket(fileno=answer).sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd)])


def mount(zygote: Any, req: dict[str, Any], fds: list[int]) -> None:
    """Attach a read-only copy of host path `source` at `target` inside the running sandbox.

    The copy is a detached mount tree (open_tree) made in a mount namespace that sees the host's
    paths: the zygote's own as root, else a private copy of it made inside the sandbox's outer user
    namespace (where we may mount). Then we join the sandbox's mount namespace and move it there.
    """
    answer, source, target = fds[-1], req["source"], req["target"]
    is_dir = os.path.isdir(source)
    tree = nsx.detached_tree(source) if os.geteuid() == 0 else -1
    keep = [answer, zygote.userns.outer, zygote.ns["mnt"], *([tree] if tree >= 0 else [])]
    zygote.close_for_child(keep)
    zygote.become_host_uid()
    nsx.join(zygote.userns.outer, nsx.CLONE_NEWUSER, "user")
    if tree < 0:
        nsx.unshare(nsx.CLONE_NEWNS)
        tree = nsx.detached_tree(source)
    nsx.join(zygote.ns["mnt"], nsx.CLONE_NEWNS, "mnt")
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
    nsx.move_mount(tree, target)
    _answer(answer, {"ok": True})
