"""The zygote: the host-side process that runs one local sandbox at a time and forks its execs.

Why a zygote. Moving a process into a cgroup v1 (a write to cgroup.procs) takes the kernel's
global cgroup_threadgroup_rwsem for writing, which waits for an RCU grace period and holds back
every fork on the host meanwhile: ~0.3 ms on a busy host, ~10-20 ms on an idle one (measured in
bench/results/sandbox.md; /sys/kernel/rcu_expedited=1 makes it vanish). A child forked by a
process already inside the cgroup is in it from birth, with no such write. So the zygote joins
the sandbox's pids cgroup once, and everything of the sandbox (its bwrap, init, keeper, every
exec) is a fork of it; the provider recycles zygote+cgroup pairs across sandboxes.

What a sandbox is (one at a time per zygote). `start` runs one long-lived bwrap that builds the
sandbox's namespaces and mounts (with the zygote's user namespace pair, namespaces.py), then
plants the keeper: a host process inside the sandbox's pid namespace, adopted by the sandbox's
init, that the sandbox's own processes can neither see into nor signal (as root it is host root;
their uid is another). The keeper reads a pipe whose only writer is the zygote; at EOF (`stop`,
or the zygote's death, however it dies) it SIGKILLs every process of the pid namespace and exits,
and with nothing left the init exits too. So processes an exec starts keep running (a server is
still there for the next exec and the verifier) until the sandbox stops, and nothing outlives it.
`exec` forks a child that enters the sandbox (namespaces.enter) and forks the command inside;
that child stays outside the pid namespace, waits, and reports the command's host pid and exit.

This file runs as a script with the host's python (stdlib only, `-S -E`), never imported by us;
namespaces.py is its sibling import. Protocol over a SOCK_SEQPACKET socket (fd argv[1]): one
JSON request per packet with SCM_RIGHTS fds; the last fd is where the answer goes (JSON lines),
so the zygote never writes to the socket; a request too big for one packet comes in a memfd
(`"memfd": true`, the fd before the answer's). Requests:
  start {bwrap, options, idmap: [rootfs, target] | null}  fds [log, answer]: {"init": pid} | {"error"}
  exec  {argv, env, cwd, ids: [uid, gid, groups], rlimits}  fds [stdin, stdout, stderr, answer]:
        {"child-pid": host pid} then {"exit-code": n} (128+N for signal N) | {"error"}
  listen {port}  fds [answer socket]: {"port": n} with the listening socket's fd (SCM_RIGHTS)
  mount {source, target}  fds [answer]: {"ok": true} | {"error"}
  stop {}  fds [answer]: {"stopped": bool}
argv: <socket fd> <host uid> <span> <cgroup.procs path or "">. On EOF the zygote stops its
sandbox, kills whatever else is left in its cgroup and exits.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import sys
import time

import namespaces as nsx  # type: ignore[import-not-found]  # sibling modules (sys.path[0])
import zygote_child  # type: ignore[import-not-found]

_MAX_FDS = 6
_START_TIMEOUT_S = 60.0
# bwrap's own first child, run once the sandbox is set up: it fails to exec, on purpose (no
# binary of the root filesystem is needed), and bwrap's monitor exits; the keeper holds the init.
_NOT_A_COMMAND = "/.miles-env-sandbox-ready"
_KEEPER = "read _; n=0; while kill -9 -1 2>/dev/null && [ $n -lt 100000 ]; do n=$((n+1)); done"
_NS_NAMES = [name for name, _ in nsx.SANDBOX_NS]


class Zygote:
    def __init__(self, sock: socket.socket, uid: int, span: int, procs: str) -> None:
        self.sock, self.uid, self.span, self.procs = sock, uid, span, procs
        self.userns: nsx.Userns | None = None  # made by the first start, kept for every sandbox
        self.ns: dict[str, int] = {}  # the running sandbox's namespaces
        self.init_fd = -1  # pidfd of its init
        self.keeper = -1  # the write end the keeper reads

    # -- helpers ---------------------------------------------------------------------------
    def own_fds(self) -> list[int]:
        fds = [self.sock.fileno(), self.init_fd, self.keeper, *self.ns.values()]
        if self.userns is not None:
            fds += [self.userns.outer, self.userns.inner]
        return [fd for fd in fds if fd >= 0]

    def close_for_child(self, keep: list[int]) -> None:
        """In a fork: close what is the zygote's (above all the keeper's pipe and the socket)."""
        for fd in self.own_fds():
            if fd not in keep:
                os.close(fd)

    def become_host_uid(self) -> None:
        if os.geteuid() == 0:
            os.setgroups([])
            os.setresgid(self.uid, self.uid, self.uid)
            os.setresuid(self.uid, self.uid, self.uid)

    # -- start -----------------------------------------------------------------------------
    def start(self, req: dict, fds: list[int]) -> dict:
        log, answer = fds[0], fds[-1]
        if self.ns:
            self.stop()
        if self.userns is None:
            self.userns = nsx.make_userns(self.uid, self.span)
        if req.get("idmap"):
            rootfs, target = req["idmap"]
            tree = nsx.idmapped_tree(rootfs, self.userns.outer)
            try:
                nsx.move_mount(tree, target)
            finally:
                os.close(tree)
        status_r, status_w = os.pipe()
        block_r, block_w = os.pipe()
        argv = [req["bwrap"], "--userns", "3", "--userns2", "4", "--json-status-fd", "5", "--block-fd", "6"]
        argv += [*req["options"], "--", _NOT_A_COMMAND]
        if os.fork() == 0:
            self._exec_bwrap(argv, [self.userns.outer, self.userns.inner, status_w, block_r], log, answer)
        os.close(status_w)
        os.close(block_r)
        try:
            return self._await_init(status_r, block_w)
        finally:
            os.close(status_r)
            if block_w >= 0:
                os.close(block_w)

    def _exec_bwrap(self, argv: list[str], fds: list[int], log: int, answer: int) -> None:
        try:
            os.setsid()
            for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):  # ignored here; bwrap waits
                signal.signal(sig, signal.SIG_DFL)
            self.become_host_uid()
            nsx.die_with_parent()  # set after the uid change, which would clear it
            null = os.open(os.devnull, os.O_RDWR)
            for target, fd in [(0, null), (1, null), (2, log), *((3 + i, fd) for i, fd in enumerate(fds))]:
                os.dup2(fd, target)
            os.closerange(3 + len(fds), os.sysconf("SC_OPEN_MAX"))
            os.execv(argv[0], argv)
        except BaseException as e:  # noqa: BLE001 - reported on the log, then die
            os.write(log, f"miles-env zygote: cannot run {argv[0]}: {e}\n".encode())
        finally:
            os._exit(127)

    def _await_init(self, status_r: int, block_w: int) -> dict:
        lines = _JsonLines(status_r, self.sock)
        first = lines.next()
        if first is None or "child-pid" not in first:
            return {"error": "bwrap exited before it made the sandbox (its log says why)"}
        init = int(first["child-pid"])
        self.init_fd = os.pidfd_open(init)
        self.ns = {name: os.open(f"/proc/{init}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC) for name in _NS_NAMES}
        self.keeper = self._plant_keeper(self.ns["pid"])
        os.write(block_w, b"x")  # bwrap may now run its first child, which exits at once
        while lines.next() is not None:
            pass
        # bwrap exits once its first child has (run and) failed, or once setup failed: then the
        # init, which did the setup, died first. Alive, it is the set-up sandbox's (the keeper's).
        if not select.select([self.init_fd], [], [], 0)[0]:
            return {"init": init}
        self.stop()
        return {"error": "bwrap could not set the sandbox up (its log says why)"}

    def _plant_keeper(self, pidns: int) -> int:
        """Fork the keeper into the sandbox's pid namespace; return once its init has adopted it."""
        read_end, write_end = os.pipe()
        outer = os.fork()
        if outer == 0:
            code = 0
            try:
                self.close_for_child([pidns, read_end])
                os.close(write_end)
                nsx.join(pidns, nsx.CLONE_NEWPID, "pid")
                inner = os.fork()  # pid N inside; its child is orphaned when it exits, so the
                if inner == 0:  # sandbox's init adopts it: the keeper
                    if os.fork() == 0:
                        self._exec_keeper(read_end)
                    os._exit(0)
                _wait(inner)  # when this returns, the keeper's parent is the init
            except BaseException as e:  # noqa: BLE001
                os.write(2, f"miles-env zygote: keeper: {e}\n".encode())
                code = 1
            finally:
                os._exit(code)
        os.close(read_end)
        _wait(outer)
        return write_end

    def _exec_keeper(self, read_end: int) -> None:
        try:
            os.setsid()
            os.chdir("/")
            null = os.open(os.devnull, os.O_RDWR)
            for target, fd in ((0, read_end), (1, null), (2, null)):
                os.dup2(fd, target)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            os.execv("/bin/sh", ["miles-env-keeper", "-c", _KEEPER])
        finally:
            os._exit(127)

    # -- stop ------------------------------------------------------------------------------
    def stop(self) -> bool:
        """End the running sandbox: the keeper kills all of it; wait for its init to be gone."""
        if self.keeper >= 0:
            os.close(self.keeper)
            self.keeper = -1
        gone = True
        if self.init_fd >= 0:
            gone = bool(select.select([self.init_fd], [], [], 10.0)[0])
            os.close(self.init_fd)
            self.init_fd = -1
        for fd in self.ns.values():
            os.close(fd)
        self.ns = {}
        return gone

    def kill_cgroup(self) -> None:
        """SIGKILL everything else in our cgroup (execs' outer halves still winding down)."""
        if not self.procs:
            return
        for _ in range(100):
            try:
                with open(self.procs) as f:
                    pids = [int(p) for p in f.read().split() if int(p) != os.getpid()]
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            select.select([], [], [], 0.005)

    # -- exec, listen, mount (zygote_child.py) ------------------------------------------------
    def fork(self, op: str, req: dict, fds: list[int]) -> None:
        """exec, listen, mount: in a child of ours (zygote_child.py), which answers on fds[-1]."""
        try:
            pid = os.fork()
        except OSError as e:
            if op != "exec":
                raise
            zygote_child.cannot_fork(fds[2], fds[-1], e)  # the sandbox's process limit
            return
        if pid == 0:
            code = 0
            try:
                getattr(zygote_child, op)(self, req, fds)
            except BaseException as e:  # noqa: BLE001 - answered, then the child dies
                _answer(fds[-1], {"error": f"{type(e).__name__}: {e}"})
                code = 1
            finally:
                os._exit(code)


class _JsonLines:
    """JSON objects, one per line, from bwrap's --json-status-fd; None at its EOF, or if the owner
    goes away (EOF on our socket) or nothing comes for _START_TIMEOUT_S."""

    def __init__(self, fd: int, sock: socket.socket) -> None:
        self.fd, self.sock, self.buf = fd, sock, b""
        self.deadline = time.monotonic() + _START_TIMEOUT_S
        self.watch: list[int] = [fd, sock.fileno()]

    def next(self) -> dict | None:
        while b"\n" not in self.buf:
            ready = select.select(self.watch, [], [], max(0.0, self.deadline - time.monotonic()))[0]
            if not ready:
                return None
            if self.sock.fileno() in ready:
                if not self.sock.recv(1, socket.MSG_PEEK):
                    return None  # the owner is gone
                self.watch = [self.fd]  # a request is waiting: the owner is there, look no more
                continue
            chunk = os.read(self.fd, 4096)
            if not chunk:
                rest, self.buf = self.buf.strip(), b""
                return json.loads(rest) if rest else None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line) if line.strip() else self.next()


def _wait(pid: int) -> None:
    """Until child `pid` has exited (with SIGCHLD ignored the kernel reaps it: then ECHILD)."""
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _receive(sock: socket.socket) -> tuple[dict, list[int]] | None:
    fds = array.array("i")
    msg, ancdata, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(_MAX_FDS * fds.itemsize))
    if not msg:
        return None
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    req, got = json.loads(msg), list(fds)
    if req.pop("memfd", False):  # the real request is in the fd before the answer's
        memfd = got.pop(-2)
        with os.fdopen(memfd, "rb") as f:
            req = {**json.loads(f.read()), **req}
    return req, got


def _answer(fd: int, msg: dict) -> None:
    try:
        os.write(fd, json.dumps(msg).encode() + b"\n")
    except OSError:
        pass  # the owner stopped listening (a cancelled call): nothing to tell


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    zygote = Zygote(sock, int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps our children
    nsx.set_child_subreaper()  # each sandbox's init, once its bwrap monitor exits, and keepers' parents
    while (got := _receive(sock)) is not None:
        req, fds = got
        op = req.get("op")
        try:
            if op == "start":
                _answer(fds[-1], zygote.start(req, fds))
            elif op == "stop":
                gone = zygote.stop()
                zygote.kill_cgroup()
                _answer(fds[-1], {"stopped": gone})
            elif op in ("exec", "listen", "mount"):
                zygote.fork(op, req, fds)
            else:
                _answer(fds[-1], {"error": f"unknown request {op!r}"})
        except Exception as e:  # noqa: BLE001 - one failed request, not a dead zygote
            if fds:
                _answer(fds[-1], {"error": f"{type(e).__name__}: {e}"})
        finally:
            for fd in fds:
                os.close(fd)
    zygote.stop()
    zygote.kill_cgroup()


if __name__ == "__main__":
    main()
