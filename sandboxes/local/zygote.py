"""The zygote: the host-side process that runs one local sandbox at a time and forks its execs.

Why a zygote. Moving a process into a cgroup v1 (a write to cgroup.procs) takes the kernel's
global cgroup_threadgroup_rwsem for writing, which waits for an RCU grace period and holds back
every fork on the host meanwhile: ~0.3 ms busy, ~10-20 ms idle (bench/results/sandbox.md). A child
forked inside the cgroup is in it from birth, with no such write. So the zygote joins the pids
cgroup once, and all of the sandbox (init, bwrap, execs) is a fork of it; the provider recycles
zygote+cgroup pairs across sandboxes.

What a sandbox is (one at a time per zygote). `start` makes its pid namespace (owned by the outer
user namespace, namespaces.py) with our init as pid 1, runs one bwrap in it that builds the other
namespaces and mounts, and keeps their fds. The init adopts every
orphan (and, SIGCHLD ignored, reaps it at once) and reads a pipe whose only writer is the zygote: at
EOF (`stop`, or the zygote's death, however it dies) it exits, and the kernel kills every process
of its namespace. No process inside can signal or trace it. So processes an exec starts keep
running (a server is still there for the next exec and the verifier) until the sandbox stops, and
nothing outlives it. Its network namespace opens ports < 1024, as Docker's; with network, it gets
slirp4netns, a child of ours ending at EOF on a pipe only we write (network.py). `exec` forks a
child that enters the sandbox (namespaces.enter) and forks the command inside; that child stays
outside the pid namespace, waits, and reports the command's host pid and exit status.

This file runs as a script with the host's python (stdlib only, `-S -E`), never imported by us;
namespaces.py is its sibling import. Protocol over a SOCK_SEQPACKET socket (fd argv[1]): one
JSON request per packet with SCM_RIGHTS fds; the last fd is where the answer goes (JSON lines),
so the zygote never writes to the socket; a request too big for one packet comes in a memfd
(`"memfd": true`, the fd before the answer's). Requests:
  start {bwrap, options, idmap: [rootfs, target] | null, slirp4netns: path | null, netns: bool}
        fds [answer], or with netns [another sandbox's network namespace, answer] (a sidecar's:
        its sandbox shares that namespace, joined as host root, instead of a new one):
        {"init": pid} (its network up first) | {"error": log}
  netns {}  fds [answer socket]: the running sandbox's network namespace fd (SCM_RIGHTS), for
        its sidecars' start
  exec  {argv, env, cwd, ids: [uid, gid, groups], rlimits}  fds [stdin, stdout, stderr, answer]:
        {"child-pid": host pid} then {"exit-code": n} (128+N for signal N) | {"error"}
  listen {port}  fds [answer socket]: {"port": n} with the listening socket's fd (SCM_RIGHTS)
  mount {source, target}  fds [answer]: {"ok": true} | {"error"}
  stop {}  fds [answer]: {"stopped": bool}: true once the sandbox's init and all else in our
        cgroup is gone (only then may we serve another); the next init is made before the answer
argv: <socket fd> <host uid> <span> <cgroup.procs path or "">, overwritten once read (with the
python and script paths: no fork shows a host path, nsx.set_title). On EOF it stops its sandbox,
kills what is left in its cgroup and exits.
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
import network  # type: ignore[import-not-found]
import zygote_child  # type: ignore[import-not-found]

_MAX_FDS = 6
_START_TIMEOUT_S = 60.0
# What bwrap execs once the sandbox is set up: it fails to, on purpose (no binary of the root
# filesystem is needed), and bwrap exits; the namespaces live on in our fds and our init.
_NOT_A_COMMAND = "/.miles-env-sandbox-ready"
_NS_NAMES = [name for name, _ in nsx.SANDBOX_NS]


class Zygote:
    def __init__(self, sock: socket.socket, uid: int, span: int, procs: str) -> None:
        self.sock, self.uid, self.span, self.procs = sock, uid, span, procs
        self.userns: nsx.Userns | None = None  # made by the first start, kept for every sandbox
        self.ns: dict[str, int] = {}  # the running sandbox's namespaces
        self.init_fd = -1  # pidfd of its init
        self.init_pipe = -1  # the write end its init reads: closing it ends the sandbox
        self.next_init: tuple[int, int, int, int] | None = None  # made ahead for the next start
        self.netstack: network.Netstack | None = None  # the running sandbox's network, if it has one
        self.shared_net = False  # the running sandbox's network namespace is another's (a sidecar)

    # -- helpers ---------------------------------------------------------------------------
    def own_fds(self) -> list[int]:
        fds = [self.sock.fileno(), self.init_fd, self.init_pipe, *self.ns.values()]
        fds += [*(self.next_init or ())[1:], *(self.netstack.fds() if self.netstack else ())]
        if self.userns is not None:
            fds += [self.userns.outer, self.userns.inner]
        return [fd for fd in fds if fd >= 0]

    def close_for_child(self, keep: list[int]) -> None:
        """In a fork: close what is the zygote's (above all the init's pipe and the socket)."""
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
        init = self._take_init()
        status_r, status_w = os.pipe()
        block_r, block_w = os.pipe()
        log_r, log_w = os.pipe()
        argv = [req["bwrap"], "--userns", "3", "--userns2", "4", "--pidns", "5", "--json-status-fd", "6"]
        argv += ["--block-fd", "7", *req["options"], "--", _NOT_A_COMMAND]
        netns = fds[0] if req.get("netns") else -1
        self.shared_net = netns >= 0
        if os.fork() == 0:
            self._exec_bwrap(
                argv, [self.userns.outer, self.userns.inner, self.ns["pid"], status_w, block_r], log_w, netns
            )
        for fd in (status_w, block_r, log_w):
            os.close(fd)
        try:
            answer = self._await_setup(init, status_r, block_w, log_r)
        finally:
            for fd in (status_r, block_w, log_r):
                os.close(fd)
        if "init" in answer and not self.shared_net:  # a shared one is its owner's to set
            network.open_low_ports(self)  # ports < 1024 in its own network namespace, as Docker
        if "init" in answer and req.get("slirp4netns"):
            try:
                self.netstack = network.attach(self, req["slirp4netns"])
            except OSError as e:
                self.stop()
                return {"error": str(e)}
        return answer

    def prepare_init(self) -> None:
        """Make the next sandbox's pid namespace and init ahead (when idle: off start's path)."""
        if self.next_init is None:
            if self.userns is None:
                self.userns = nsx.make_userns(self.uid, self.span)
            self.next_init = self._make_init()

    def _take_init(self) -> int:
        self.prepare_init()
        assert self.next_init is not None
        init, self.init_fd, pidns, self.init_pipe = self.next_init
        self.next_init = None
        self.ns = {"pid": pidns}
        return init

    def _make_init(self) -> tuple[int, int, int, int]:
        """A pid namespace owned by our outer user namespace, with an init of ours as its pid 1:
        (its host pid, a pidfd, the namespace's fd, the write end of the pipe it reads)."""
        assert self.userns is not None
        read_end, write_end = os.pipe()
        tell_r, tell_w = os.pipe()
        child = os.fork()
        if child == 0:
            code = 0
            try:
                self.close_for_child([self.userns.outer, read_end, tell_w])
                os.close(write_end)
                nsx.join(self.userns.outer, nsx.CLONE_NEWUSER, "user")
                nsx.unshare(nsx.CLONE_NEWPID)
                init = os.fork()  # pid 1 of the new namespace
                if init == 0:
                    _run_init(read_end)
                os.write(tell_w, str(init).encode())
            except BaseException as e:  # noqa: BLE001 - the parent sees no pid
                os.write(2, f"miles-env zygote: the sandbox's init: {e}\n".encode())
                code = 1
            finally:
                os._exit(code)
        os.close(read_end)
        os.close(tell_w)
        try:
            got = os.read(tell_r, 16)
        finally:
            os.close(tell_r)
        _wait(child)  # gone before we answer: the sandbox's cgroup then holds only us and the init
        if not got.isdigit():
            os.close(write_end)
            raise OSError(0, "could not start the sandbox's init")
        init = int(got)
        pidns = os.open(f"/proc/{init}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        return init, os.pidfd_open(init), pidns, write_end

    def _exec_bwrap(self, argv: list[str], fds: list[int], log: int, netns: int = -1) -> None:
        try:
            os.setsid()
            for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):  # ignored here; bwrap waits
                signal.signal(sig, signal.SIG_DFL)
            if netns >= 0:  # a sidecar: bwrap (no --unshare-net) keeps the namespace it starts in
                nsx.join(netns, nsx.CLONE_NEWNET, "net (shared)")
            self.become_host_uid()
            nsx.die_with_parent()  # set after the uid change, which would clear it
            null = os.open(os.devnull, os.O_RDWR)
            nsx.place_fds([null, null, log, *fds])
            os.execv(argv[0], argv)
        except BaseException as e:  # noqa: BLE001 - reported on the log, then die
            os.write(log, f"miles-env zygote: cannot run {argv[0]}: {e}\n".encode())
        finally:
            os._exit(127)

    def _await_setup(self, init: int, status_r: int, block_w: int, log_r: int) -> dict:
        lines = _JsonLines(status_r, self.sock)
        first = lines.next()
        if first is not None and "child-pid" in first:
            setup = int(first["child-pid"])  # bwrap's process in our pid namespace, doing the mounts
            for name in _NS_NAMES:
                if name != "pid":
                    self.ns[name] = os.open(f"/proc/{setup}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
            os.write(block_w, b"x")  # it may now exec its command, and fail to
            while lines.next() is not None:
                pass
        os.set_blocking(log_r, False)
        try:
            log = os.read(log_r, 1 << 16).decode(errors="replace")
        except BlockingIOError:
            log = ""
        # bwrap tries to exec the command only once everything is mounted: that attempt's message
        # is the proof of a complete sandbox (no binary of the root filesystem is needed for it).
        if f"execvp {_NOT_A_COMMAND}:" in log and not select.select([self.init_fd], [], [], 0)[0]:
            return {"init": init}
        self.stop()
        return {"error": f"bwrap could not set the sandbox up: {log.strip()[-1500:]}"}

    # -- stop ------------------------------------------------------------------------------
    def stop(self) -> bool:
        """End the running sandbox: its init reads EOF and exits, and with it the kernel kills every
        process of the pid namespace, then its network's slirp4netns; True once all are gone."""
        if self.init_pipe >= 0:
            os.close(self.init_pipe)
            self.init_pipe = -1
        gone = True
        if self.init_fd >= 0:
            gone = bool(select.select([self.init_fd], [], [], 10.0)[0])
            os.close(self.init_fd)
            self.init_fd = -1
        if self.netstack is not None:
            gone = self.netstack.detach() and gone
            self.netstack = None
        for fd in self.ns.values():
            os.close(fd)
        self.ns = {}
        self.shared_net = False
        return gone

    def kill_cgroup(self) -> bool:
        """SIGKILL everything else in our cgroup (execs' outer halves still winding down); True once
        we are alone in it (then we may serve another sandbox)."""
        if not self.procs:
            return True
        for _ in range(200):
            try:
                with open(self.procs) as f:
                    pids = [int(p) for p in f.read().split() if int(p) != os.getpid()]
            except OSError:
                return False
            if not pids:
                return True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            select.select([], [], [], 0.005)
        return False

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


def _run_init(read_end: int) -> None:
    """The sandbox's pid 1: adopts every orphan and, as SIGCHLD is ignored, never leaves a zombie;
    at EOF on `read_end` (the zygote closed it, or died) it exits, and the kernel kills the rest of
    its pid namespace. No process inside can signal it (a namespace's init gets only the signals it
    handles, and it handles none) or trace it (not dumpable, no capability, and as root another uid)."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # python's handler would let a SIGINT end it
        nsx.set_title("miles-env-init")  # what a sandbox sees as its pid 1
        os.setsid()
        os.chdir("/")
        null = os.open(os.devnull, os.O_RDWR)
        nsx.place_fds([read_end, null, null])
        nsx.no_capabilities()
        while os.read(0, 64):
            pass
    finally:
        os._exit(0)


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


def _send_netns(zygote: Zygote, answer: int) -> None:
    """The running sandbox's network namespace fd, on the answer socket (for its sidecars)."""
    net = zygote.ns.get("net", -1)
    with socket.socket(fileno=os.dup(answer)) as sock:
        if net < 0:
            sock.send(json.dumps({"error": "no sandbox is running"}).encode())
        else:
            socket.send_fds(sock, [b"{}"], [net])


def _answer(fd: int, msg: dict) -> None:
    try:
        os.write(fd, json.dumps(msg).encode() + b"\n")
    except OSError:
        pass  # the owner stopped listening (a cancelled call): nothing to tell


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    zygote = Zygote(sock, int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    nsx.set_title("miles-env-zygote")  # no host path in any fork's cmdline (an exec's, before it execs)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps our children
    nsx.set_child_subreaper()  # each sandbox's init, once the child that made it has exited
    zygote.prepare_init()
    while (got := _receive(sock)) is not None:
        req, fds = got
        op = req.get("op")
        try:
            if op == "start":
                _answer(fds[-1], zygote.start(req, fds))
            elif op == "stop":
                gone = zygote.stop()
                alone = zygote.kill_cgroup()
                if gone and alone:  # before the answer: an idle zygote's cgroup is then settled
                    zygote.prepare_init()
                _answer(fds[-1], {"stopped": gone and alone})
            elif op == "netns":
                _send_netns(zygote, fds[-1])
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
