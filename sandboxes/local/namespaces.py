"""The Linux calls a local sandbox is made of: user namespaces, setns, idmapped and detached mounts.

Stdlib only (ctypes): the zygote (zygote.py, run as a script with the host's python) imports
this module as its sibling; the provider imports it too. Every function raises OSError with
the call's name on failure.

User namespaces. A sandbox's processes live in a pair of user namespaces that the zygote makes
once and keeps for every sandbox it serves: `outer` maps the sandbox ids 0..span-1 to the host
ids uid..uid+span-1 and is owned by host uid `uid`; `inner`, nested in it, maps the same ids
again and is the one processes run in. outer's user.max_user_namespaces is 1 and inner uses it
up, so nothing inside can make another user namespace (bwrap's --disable-userns, which bwrap
cannot do with namespaces it is given). As root span is 65536 (an image's users, nobody
included); without root it is 1 (the caller's own uid, mapped to 0): only root can map more.

Entering. `enter()` moves the calling (single-threaded) process into a running sandbox: become
the sandbox's host uid, join `outer` (its owner gets every capability there), the mount, pid,
net, ipc, uts and cgroup namespaces (all owned by `outer`), then `inner`. Joining the mount
namespace sets root and cwd to the sandbox's root. The pid namespace applies to children only,
so the caller forks next. `drop_to()` then becomes the image's user and gives up every
capability for good (bounding set), but for ROOT_CAPS when that user is root.

Setuid files act as in Docker (no no_new_privs): an image's setuid-root helper (a task's way to let
its non-root user reach a root-only file) runs as the sandbox's uid 0, with no capability beyond
the bounding set (none, for a non-root user) and only over files the sandbox's user namespace
maps. What the sandbox writes lands on the host's nosuid storage (storage.py): a setuid bit set
inside never acts outside it.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal

__all__ = [
    "CLONE_NEWNET",
    "CLONE_NEWNS",
    "CLONE_NEWUSER",
    "Userns",
    "detached_tree",
    "die_with_parent",
    "drop_to",
    "enter",
    "idmapped_tree",
    "join",
    "make_userns",
    "mount",
    "move_mount",
    "no_capabilities",
    "place_fds",
    "set_child_subreaper",
    "set_title",
]

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x20000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x10000000, 0x20000000, 0x40000000
# The namespaces of a sandbox other than its user namespaces, in the order enter() joins them.
SANDBOX_NS = (
    ("mnt", CLONE_NEWNS),
    ("pid", CLONE_NEWPID),
    ("net", CLONE_NEWNET),
    ("ipc", CLONE_NEWIPC),
    ("uts", CLONE_NEWUTS),
    ("cgroup", CLONE_NEWCGROUP),
)
# New mount API (Linux 5.2+; mount_setattr 5.12+): the same numbers on every architecture.
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC, _AT_RECURSIVE, _AT_EMPTY_PATH = 1, 0o2000000, 0x8000, 0x1000
_MOVE_MOUNT_F_EMPTY_PATH = 4
_ATTR_RDONLY, _ATTR_NOSUID, _ATTR_NODEV, _ATTR_IDMAP = 0x1, 0x2, 0x4, 0x100000
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER = 1, 4, 24, 36
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_PR_SET_NAME = 15
_CAP_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def join(fd: int, flag: int, what: str = "namespace") -> None:
    _check(_libc.setns(fd, flag), f"setns({what})")


def mount(source: str, target: str, fstype: str, flags: int, data: str = "") -> None:
    """mount(2) (flags: MS_*); as root, in a mount namespace of our own."""
    result = _libc.mount(
        source.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags), data.encode()
    )
    _check(result, f"mount({target})")


def place_fds(fds: list[int]) -> None:
    """Make fds[i] our fd i, for every i, and close everything else (in a child, before exec).

    Each goes through a copy above all of them first: a plain dup2 in order would clobber a
    source that happens to sit at a lower target's number."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in fds]
    for target, fd in enumerate(high):
        os.dup2(fd, target)
    os.closerange(len(fds), os.sysconf("SC_OPEN_MAX"))


def _prctl(option: int, arg: int = 0) -> int:
    return _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0)


def die_with_parent() -> None:
    """SIGKILL us when our parent dies (cleared by a later uid change: call it after)."""
    _check(_prctl(_PR_SET_PDEATHSIG, signal.SIGKILL), "prctl(PR_SET_PDEATHSIG)")


def set_child_subreaper() -> None:
    """Orphans below us (a sandbox's init once its bwrap monitor exits) become our children."""
    _check(_prctl(_PR_SET_CHILD_SUBREAPER, 1), "prctl(PR_SET_CHILD_SUBREAPER)")


def set_title(title: str) -> None:
    """Make our /proc/<pid>/cmdline `title` (then NULs) and our comm its first 15 bytes, for us
    and every later fork: the host paths we were started with (python, the script, the cgroup)
    are overwritten in place, in the argv area the kernel reads cmdline from (its bounds are
    fields 48-49 of /proc/self/stat; python keeps copies of its argv, never this memory)."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49; 3 is fields[0])
    data = title.encode()[: max(0, end - start - 1)]
    ctypes.memset(start, 0, end - start)
    ctypes.memmove(start, data, len(data))
    _libc.prctl(_PR_SET_NAME, title.encode()[:15], 0, 0, 0)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def detached_tree(path: str, *, userns: int | None = None) -> int:
    """A detached, recursive, read-only (nosuid, nodev) copy of the mount tree at `path`, as an fd.

    With `userns`, the copy is idmapped through it: a file its filesystem says uid k owns is
    owned by whatever host uid k maps to in `userns` (so an image's files keep their owners
    inside the sandbox whose user namespace that is, without being chowned on disk).
    """
    flags = _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | _AT_RECURSIVE
    fd = _check(_libc.syscall(_SYS_OPEN_TREE, -100, path.encode(), flags), f"open_tree({path})")
    attr = _MountAttr(_ATTR_RDONLY | _ATTR_NOSUID | _ATTR_NODEV, 0, 0, 0)
    if userns is not None:
        attr.attr_set |= _ATTR_IDMAP
        attr.userns_fd = userns
    try:
        what = f"mount_setattr({path})"
        size = ctypes.sizeof(attr)
        _check(
            _libc.syscall(
                _SYS_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH | _AT_RECURSIVE, ctypes.byref(attr), size
            ),
            what,
        )
    except OSError:
        os.close(fd)
        raise
    return fd


def idmapped_tree(path: str, userns: int) -> int:
    return detached_tree(path, userns=userns)


def move_mount(fd: int, target: str) -> None:
    """Attach the detached tree `fd` at `target` (in the caller's mount namespace)."""
    _check(
        _libc.syscall(_SYS_MOVE_MOUNT, fd, b"", -100, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH),
        f"move_mount({target})",
    )


class Userns:
    """The (outer, inner) user namespace pair of a zygote's sandboxes, as open fds."""

    def __init__(self, outer: int, inner: int, uid: int, span: int) -> None:
        self.outer, self.inner, self.uid, self.span = outer, inner, uid, span

    def close(self) -> None:
        for fd in (self.outer, self.inner):
            os.close(fd)


def _write(path: str, data: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


def _userns_child(uid: int, span: int, to_parent: int, from_parent: int) -> None:
    """In a fork: make `outer` (as host uid `uid`), wait for its maps, then `inner` in a child."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        _prctl(_PR_SET_DUMPABLE, 1)  # our /proc files stay ours after the uid change: the maps
    unshare(CLONE_NEWUSER)
    if span == 1:  # unprivileged: we may map only ourselves, and only with setgroups denied
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"0 {uid} 1")
        _write("/proc/self/gid_map", f"0 {os.getegid()} 1")
    os.write(to_parent, b"o")
    os.read(from_parent, 1)  # the parent has written outer's maps (as root)
    _write("/proc/sys/user/max_user_namespaces", "1")  # outer's own limit: inner takes the one
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    inner = os.fork()
    if inner == 0:
        unshare(CLONE_NEWUSER)
        os.write(ready_w, b"i")
        os.read(hold_r, 1)
        os._exit(0)
    os.read(ready_r, 1)
    for name in ("uid_map", "gid_map"):  # we are root in outer, with every capability there
        _write(f"/proc/{inner}/{name}", f"0 0 {span}")
    os.write(to_parent, str(inner).encode())
    os.read(from_parent, 1)  # the parent holds inner's fd now
    os.write(hold_w, b"x")


def make_userns(uid: int, span: int) -> Userns:
    """The user namespace pair for host ids uid..uid+span-1 (span > 1 needs root)."""
    up_r, up_w = os.pipe()
    down_r, down_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(up_r)
            os.close(down_w)
            _userns_child(uid, span, up_w, down_r)
        except BaseException as e:  # noqa: BLE001 - reported through the pipe's EOF and stderr
            os.write(2, f"miles-env zygote: user namespaces: {e}\n".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(up_w)
    os.close(down_r)
    try:
        if os.read(up_r, 1) != b"o":
            raise OSError(0, "making the sandbox's user namespace failed (see stderr)")
        outer = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        if span > 1:
            for name in ("uid_map", "gid_map"):
                _write(f"/proc/{pid}/{name}", f"0 {uid} {span}")
        os.write(down_w, b"m")
        got = os.read(up_r, 16)
        if not got.isdigit():
            os.close(outer)
            raise OSError(0, "making the sandbox's nested user namespace failed (see stderr)")
        inner = os.open(f"/proc/{int(got)}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        os.write(down_w, b"x")
    finally:
        for fd in (up_r, down_w):
            os.close(fd)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # reaped by the kernel (SIGCHLD ignored in the zygote)
    return Userns(outer, inner, uid, span)


def enter(userns: Userns, ns: dict[str, int], *, foreign_net: bool = False) -> None:
    """Join a running sandbox (the namespaces' fds in `ns`); the caller forks next (pid namespace).
    `foreign_net`: its network namespace is another sandbox's (a sidecar's, sandboxes/local/
    sidecars.py), owned by a user namespace that is not `userns.outer`: joined first, as host root
    (the only one allowed to), before the uid change."""
    skip: tuple[str, ...] = ()
    if foreign_net:
        join(ns["net"], CLONE_NEWNET, "net (shared)")
        skip = ("net",)
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(userns.uid, userns.uid, userns.uid)
        os.setresuid(userns.uid, userns.uid, userns.uid)
    join(userns.outer, CLONE_NEWUSER, "user")
    for name, flag in SANDBOX_NS:
        if name in ns and name not in skip:
            join(ns[name], flag, name)
    join(userns.inner, CLONE_NEWUSER, "user (inner)")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return 40


def no_capabilities() -> None:
    """Give up every capability for good (none to regain at exec either), and be untraceable."""
    for cap in range(_last_cap() + 1):
        _prctl(_PR_CAPBSET_DROP, cap)
    _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
    _prctl(_PR_SET_DUMPABLE, 0)
    header, data = _CapHeader(_CAP_VERSION_3, 0), (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")


# What a container's root holds under Docker's default set and tasks rely on (apt-get drops to
# `_apt`: SETUID, SETGID, CHOWN; root writing over other users' files: DAC_OVERRIDE, FOWNER,
# FSETID; a service on port 80: NET_BIND_SERVICE; KILL), in capability numbers. Held by the
# sandbox's uid 0 only, and only over what its user namespace owns: files whose ids it maps (never
# a host file: those show as nobody) and its own network namespace. Not MKNOD, NET_RAW, SETFCAP,
# SETPCAP, SYS_CHROOT, AUDIT_WRITE (the rest of Docker's set), nor anything beyond it.
ROOT_CAPS = (0, 1, 3, 4, 5, 6, 7, 10)  # CHOWN DAC_OVERRIDE FOWNER FSETID KILL SETGID SETUID NET_BIND_SERVICE


def drop_to(uid: int, gid: int, groups: list[int]) -> None:
    """After enter(): become these ids, with ROOT_CAPS as uid 0 and no capability as any other,
    for good (bounding set, ambient and inheritable cleared: no exec, setuid-root files included,
    gets a capability outside the bounding set)."""
    keep = ROOT_CAPS if uid == 0 else ()
    for cap in range(_last_cap() + 1):
        if cap not in keep:
            _prctl(_PR_CAPBSET_DROP, cap)
    _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    header, data = _CapHeader(_CAP_VERSION_3, 0), (_CapData * 2)()
    mask = sum(1 << cap for cap in keep)  # all below 32: the first word
    data[0].effective = data[0].permitted = mask
    _check(_libc.capset(ctypes.byref(header), data), "capset")
